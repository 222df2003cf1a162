"""UniProcExecutor: one Worker in the engine's own process, called directly."""

from __future__ import annotations

from vx.config import VxConfig
from vx.executor.abstract import Executor
from vx.kv_spec import KVCacheReport, KVCacheSize
from vx.step import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor(Executor):
    """One worker, same process, direct calls: no serialization of SchedulerOutput."""

    def __init__(self, config: VxConfig) -> None:
        super().__init__(config)
        from vx.gpu.worker import Worker  # torch is imported only when an engine is built

        self.worker = Worker(config)
        self.worker.init_device()
        self.worker.load_model()

    def kv_cache_reports(self) -> list[KVCacheReport]:
        return [self.worker.kv_cache_report()]

    def initialize_kv_cache(self, kv_cache: KVCacheSize) -> None:
        self.worker.initialize_kv_cache(kv_cache.num_blocks, kv_cache.groups)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.worker.shutdown()
