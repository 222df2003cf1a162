"""One worker OS process: `python -m vx.executor.worker_main` on a `Popen`, tied to the engine by two pipes.

As the engine process is tied to its client (vx/client/engine_child.py): the worker's stdin carries the
`WorkerStartup` message and then stays open, so that its end-of-file tells the worker the engine is gone (even
killed by SIGKILL); the sentinel pipe's write end is held by the worker alone, so that its read end here becomes
readable the moment the worker exits, however it exits, and can be polled beside the executor's sockets.
"""

from __future__ import annotations

import os
import signal
import site
import subprocess
import sys

from vx.executor.worker_protocol import WorkerStartup, encode_startup

_WORKER_MODULE = "vx.executor.worker_main"


class WorkerProcess:
    """A started worker process: its pid, its sentinel, and how to end it."""

    def __init__(self, startup: WorkerStartup) -> None:
        """Start the process and hand it `startup` (its `sentinel_fd` is filled in here)."""
        self.rank = startup.rank
        sentinel_r, sentinel_w = os.pipe()
        try:
            flags = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
            self._popen = subprocess.Popen([sys.executable, *flags, "-m", _WORKER_MODULE], stdin=subprocess.PIPE,
                                           pass_fds=(sentinel_w,), env=_worker_env())
        except BaseException:
            os.close(sentinel_r)
            raise
        finally:
            os.close(sentinel_w)  # the worker's copy is the only one left: its exit closes the pipe
        self.sentinel = sentinel_r
        startup.sentinel_fd = sentinel_w
        try:
            self._popen.stdin.write(encode_startup(startup))
            self._popen.stdin.flush()
        except BrokenPipeError:  # it died at once; the executor sees the sentinel
            pass

    @property
    def pid(self) -> int:
        return self._popen.pid

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def exit_description(self, wait_s: float = 1.0) -> str:
        """How the process ended ("exited with code 1", "was killed by SIGKILL"), waiting up to `wait_s` to reap
        it; "is still running" if it has not ended."""
        try:
            code = self._popen.wait(wait_s)
        except subprocess.TimeoutExpired:
            return "is still running"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds for the process to exit (and reap it); True once it has."""
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()

    def close(self) -> None:
        """Release the pipes (closing stdin tells a still-running worker to exit); idempotent."""
        if self._popen.stdin is not None and not self._popen.stdin.closed:
            try:
                self._popen.stdin.close()
            except BrokenPipeError:
                pass
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


def _worker_env() -> dict[str, str]:
    """The engine's environment, with this vx's folder first on PYTHONPATH when it is not a site-packages folder,
    so that the worker imports the vx the engine runs (its whole `sys.path` follows in the startup message)."""
    vx_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    site_dirs = {os.path.abspath(p) for p in (*site.getsitepackages(), site.getusersitepackages())}
    if vx_root not in site_dirs:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (vx_root, env.get("PYTHONPATH")) if p)
    return env
