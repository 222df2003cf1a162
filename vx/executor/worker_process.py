"""One worker OS process: `python -m vx.executor.worker_main`, tied to the engine as the engine is tied to its client
(vx/module_process.py): its stdin carries the `WorkerStartup` message and then stays open, so that its end-of-file
tells the worker the engine is gone (even killed by SIGKILL); the sentinel's read end here becomes readable the
moment the worker exits, however it exits, and is polled beside the executor's sockets."""

from __future__ import annotations

from vx.executor.worker_protocol import WorkerStartup, encode_startup
from vx.module_process import ModuleProcess

_WORKER_MODULE = "vx.executor.worker_main"


class WorkerProcess(ModuleProcess):
    """A started worker process of one rank."""

    def __init__(self, startup: WorkerStartup) -> None:
        """Start the process and hand it `startup` (its `sentinel_fd` is filled in here)."""
        self.rank = startup.rank

        def message(sentinel_fd: int) -> bytes:
            startup.sentinel_fd = sentinel_fd
            return encode_startup(startup)

        super().__init__(_WORKER_MODULE, message)

    def exit_description(self, wait_s: float = 1.0) -> str:
        """How the worker ended, after up to `wait_s` to reap it (its error can trail its exit)."""
        return super().exit_description(wait_s)
