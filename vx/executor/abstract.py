"""The engine core's handle on the workers that hold the model; each kind of executor starts and calls them its own way."""

from __future__ import annotations

from abc import ABC, abstractmethod

from vx.cache.block_table_group import KVCacheGroupSpec
from vx.cache.kv_cache_size import KVCacheSize
from vx.config import VxConfig
from vx.step import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    """The engine core's handle on the workers that hold the model."""

    def __init__(self, config: VxConfig) -> None:
        self.config = config

    @abstractmethod
    def determine_kv_cache_size(self) -> KVCacheSize: ...

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int, groups: tuple[KVCacheGroupSpec, ...] = ()) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        pass
