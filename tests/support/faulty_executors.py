"""Executors that fail on purpose, for the tests of engine faults.

An engine uses one when its config names it: `distributed_executor_backend=backend(FailAfter5Steps)`, in the
engine process as well (the class is imported there by name). Each raises inside `execute_model`, as a crash of
the model would, and counts or checks only steps that compute tokens.
"""

from __future__ import annotations

import os
import tempfile
from typing import ClassVar

from vx.config import VxConfig
from vx.executor import UniProcExecutor
from vx.step import ModelRunnerOutput, SchedulerOutput


def backend(executor_class: type) -> str:
    """The `distributed_executor_backend` value that names `executor_class`."""
    return f"{executor_class.__module__}:{executor_class.__qualname__}"


class FailAfterSteps(UniProcExecutor):
    """`execute_model` raises once `steps` model steps have run."""

    steps: ClassVar[int]

    def __init__(self, config: VxConfig) -> None:
        super().__init__(config)
        self.num_model_steps = 0

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.total_num_scheduled_tokens:
            if self.num_model_steps >= self.steps:
                raise RuntimeError(f"injected failure after {self.steps} model steps")
            self.num_model_steps += 1
        return super().execute_model(scheduler_output)


class FailAfter2Steps(FailAfterSteps):
    steps = 2


class FailAfter5Steps(FailAfterSteps):
    steps = 5


def trigger_file(engine_pid: int) -> str:
    """The file whose existence makes `FailOnceTriggered` in the engine process `engine_pid` raise."""
    return os.path.join(tempfile.gettempdir(), f"vx-test-fail-{engine_pid}")


class FailOnceTriggered(UniProcExecutor):
    """`execute_model` raises once `trigger_file(its process id)` exists: a test crashes the engine when it chooses."""

    def __init__(self, config: VxConfig) -> None:
        super().__init__(config)
        self.trigger = trigger_file(os.getpid())
        if os.path.exists(self.trigger):  # left by an earlier process with the same pid
            os.remove(self.trigger)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.total_num_scheduled_tokens and os.path.exists(self.trigger):
            raise RuntimeError(f"injected failure: {self.trigger} exists")
        return super().execute_model(scheduler_output)
