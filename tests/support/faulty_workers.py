"""Worker processes that fail on purpose, for the tests of the multiprocess executor's faults.

An engine's worker processes use one when its config names it: `worker_cls=worker(FailOnRank1WhenTriggered)`.
"""

from __future__ import annotations

import os

from tests.support.faulty_executors import trigger_file
from vx.gpu.worker import Worker
from vx.step import ModelRunnerOutput, SchedulerOutput


def worker(worker_class: type) -> str:
    """The `worker_cls` value that names `worker_class`."""
    return f"{worker_class.__module__}:{worker_class.__qualname__}"


class FailOnRank1WhenTriggered(Worker):
    """Rank 1's forward raises once `trigger_file(its engine's pid)` exists (the other ranks are left waiting in
    their collectives, as after a real crash of one rank)."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if (self.groups.rank == 1 and scheduler_output.total_num_scheduled_tokens
                and os.path.exists(trigger_file(os.getppid()))):
            raise RuntimeError("injected failure in rank 1's forward")
        return super().execute_model(scheduler_output)
