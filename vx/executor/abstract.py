"""The engine core's handle on the workers that hold the model; each kind of executor starts and calls them its own way."""

from __future__ import annotations

from abc import ABC, abstractmethod

from vx.cache.block_table_group import KVCacheGroupSpec
from vx.cache.kv_cache_size import KVCacheSize
from vx.class_path import load_class
from vx.config import VxConfig
from vx.step import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    """The engine core's handle on the workers that hold the model."""

    def __init__(self, config: VxConfig) -> None:
        self.config = config

    @staticmethod
    def get_class(config: VxConfig) -> type[Executor]:
        """The executor class that `config.parallel_config.distributed_executor_backend` names ("uni", or
        "mp", "ray", or "package.module:ClassName", imported here: in the engine process)."""
        backend = config.parallel_config.distributed_executor_backend
        if backend == "uni":
            from vx.executor.uniproc_executor import UniProcExecutor

            return UniProcExecutor
        if backend == "mp":
            from vx.executor.multiproc import MultiprocExecutor

            return MultiprocExecutor
        if backend == "ray":
            from vx.executor.ray import RayExecutor

            return RayExecutor
        return load_class(backend, Executor, "distributed_executor_backend")

    @abstractmethod
    def determine_kv_cache_size(self) -> KVCacheSize: ...

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int, groups: tuple[KVCacheGroupSpec, ...] = ()) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        pass
