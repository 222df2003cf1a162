"""UniProcExecutor: one Worker in the engine's own process, called directly."""

from __future__ import annotations

from vx.cache.block_table_group import KVCacheGroupSpec
from vx.cache.kv_cache_size import KVCacheSize
from vx.config import VxConfig
from vx.executor.abstract import Executor
from vx.step import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor(Executor):
    """One worker, same process, direct calls: no serialization of SchedulerOutput."""

    def __init__(self, config: VxConfig) -> None:
        super().__init__(config)
        from vx.gpu.worker import Worker  # torch is imported only when an engine is built

        self.worker = Worker(config)
        self.worker.init_device()
        self.worker.load_model()

    def determine_kv_cache_size(self) -> KVCacheSize:
        return self.worker.determine_kv_cache_size()

    def initialize_kv_cache(self, num_blocks: int, groups: tuple[KVCacheGroupSpec, ...] = ()) -> None:
        self.worker.initialize_kv_cache(num_blocks, groups)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.worker.shutdown()
