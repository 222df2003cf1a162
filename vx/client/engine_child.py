"""The engine's OS process: launched as `python -m vx.core.engine_main`, with a sentinel and an exit code.

Launched as its own module rather than as a multiprocessing target, so it never re-imports the application's
main module (scripts without a `__main__` guard, `python -`, `python -c` and notebooks all work). Two pipes tie
the two processes together, the way multiprocessing's spawn ties them:
- the engine's stdin: the client writes the `EngineStartup` message, then holds it open; end-of-file there tells
  the engine that the client is gone (even killed by SIGKILL);
- the sentinel: the engine holds the write end of a pipe and never writes; the client's read end becomes
  readable (end-of-file) when the engine exits, however it exits, and can be polled (ZMQ, anyio) with the sockets.
The engine's stdout and stderr are the client's.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys

from vx.core.protocol import EngineStartup, encode_startup

_ENGINE_MODULE = "vx.core.engine_main"


class EngineChild:
    """One started engine process; the parts of `multiprocessing.Process` the client uses, on a `Popen`."""

    def __init__(self, config_bytes: bytes, input_addr: str, output_addr: str, ipc_dir: str) -> None:
        sentinel_r, sentinel_w = os.pipe()
        try:
            # The interpreter's flags (-X, -W, -O, ...) carry over, as multiprocessing's spawn carries them.
            flags = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
            self._popen = subprocess.Popen(
                [sys.executable, *flags, "-m", _ENGINE_MODULE], stdin=subprocess.PIPE, pass_fds=(sentinel_w,),
                env=_engine_env())
        except BaseException:
            os.close(sentinel_r)
            raise
        finally:
            os.close(sentinel_w)  # the engine's copy is the only one left: its exit closes the pipe
        self.sentinel = sentinel_r
        """A file descriptor that becomes readable when the engine process exits (however it exits)."""
        startup = EngineStartup(config=config_bytes, input_addr=input_addr, output_addr=output_addr,
                                ipc_dir=ipc_dir, sys_path=list(sys.path), sentinel_fd=sentinel_w)
        try:
            self._popen.stdin.write(encode_startup(startup))
            self._popen.stdin.flush()
        except BrokenPipeError:  # it died at once; the handshake reports how, through the sentinel
            pass
        except BaseException:  # interrupted mid-message: this engine cannot start, stop it
            self.kill()
            self.join()
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def exitcode(self) -> int | None:
        """None while it runs; its exit code, or minus the signal that killed it (as multiprocessing reports)."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` seconds for the process to exit (and reap it); no error when it still runs."""
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()

    def close(self) -> None:
        """Release the pipes (closing the engine's stdin tells a still-running engine to exit); idempotent."""
        if self._popen.stdin is not None and not self._popen.stdin.closed:
            try:
                self._popen.stdin.close()
            except BrokenPipeError:  # the startup message was never read: the engine is gone
                pass
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


def _engine_env() -> dict[str, str]:
    """The application's environment; with this vx's folder first on PYTHONPATH when it is not a site-packages
    folder (a source checkout, or one the application put on `sys.path` itself), so that the engine imports the vx
    the application runs. Once started, the engine takes the application's whole `sys.path`."""
    vx_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    site_dirs = {os.path.abspath(p) for p in (*site.getsitepackages(), site.getusersitepackages())}
    if vx_root not in site_dirs:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (vx_root, env.get("PYTHONPATH")) if p)
    return env
