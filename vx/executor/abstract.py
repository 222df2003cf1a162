"""The engine core's handle on the workers that hold the model; each kind of executor starts and calls them its own way."""

from __future__ import annotations

from abc import ABC, abstractmethod

from vx.config import VxConfig
from vx.kv_spec import KVCacheReport, KVCacheSize
from vx.step import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    """The engine core's handle on the workers that hold the model."""

    def __init__(self, config: VxConfig) -> None:
        self.config = config

    @abstractmethod
    def kv_cache_reports(self) -> list[KVCacheReport]:
        """Every worker's report, one per rank in rank order, as the workers sent them: the engine core sizes the
        KV cache from them."""

    @abstractmethod
    def initialize_kv_cache(self, kv_cache: KVCacheSize) -> None:
        """Have every worker allocate the KV cache the engine core decided."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        pass
