"""Executors run workers: UniProcExecutor calls one Worker in the engine's own process."""

from __future__ import annotations

from abc import ABC, abstractmethod

from vx.config import VxConfig
from vx.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    """The engine core's handle on the workers that hold the model."""

    def __init__(self, config: VxConfig) -> None:
        self.config = config

    @abstractmethod
    def determine_num_kv_blocks(self) -> int: ...

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        pass


class UniProcExecutor(Executor):
    """One worker, same process, direct calls: no serialization of SchedulerOutput."""

    def __init__(self, config: VxConfig) -> None:
        super().__init__(config)
        from vx.gpu.worker import Worker  # torch is imported only when an engine is built

        self.worker = Worker(config)
        self.worker.init_device()
        self.worker.load_model()

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.worker.shutdown()
