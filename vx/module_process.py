"""A vx process launched as its own module (`python -m ...`), tied to its parent by two pipes: the engine process
(vx/client/engine_child.py) and each worker of a split model (vx/executor/worker_process.py).

Launched as a module rather than as a multiprocessing target, so it never re-imports the application's main module
(scripts without a `__main__` guard, `python -`, `python -c` and notebooks all work). The two pipes tie the
processes together the way multiprocessing's spawn ties them:
- the child's stdin: the parent writes the startup message, then holds it open; end-of-file there tells the child
  that its parent is gone (even killed by SIGKILL);
- the sentinel: the child holds the write end of a pipe and never writes; the parent's read end becomes readable
  (end-of-file) when the child exits, however it exits, and can be polled (ZMQ, anyio) beside its sockets.
The child's stdout and stderr are the parent's.
"""

from __future__ import annotations

import os
import signal
import site
import subprocess
import sys
import traceback
from typing import BinaryIO, Callable, TypeVar

T = TypeVar("T")


class ModuleProcess:
    """One started child process; the parts of `multiprocessing.Process` vx uses, on a `Popen`."""

    def __init__(self, module: str, startup_message: Callable[[int], bytes]) -> None:
        """Start `python -m module` and write it `startup_message(sentinel_fd)`: the message names the file
        descriptor the child holds the sentinel's write end at."""
        sentinel_r, sentinel_w = os.pipe()
        try:
            # The interpreter's flags (-X, -W, -O, ...) carry over, as multiprocessing's spawn carries them.
            flags = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
            self._popen = subprocess.Popen([sys.executable, *flags, "-m", module], stdin=subprocess.PIPE,
                                           pass_fds=(sentinel_w,), env=_child_env())
        except BaseException:
            os.close(sentinel_r)
            raise
        finally:
            os.close(sentinel_w)  # the child's copy is the only one left: its exit closes the pipe
        self.sentinel = sentinel_r
        """A file descriptor that becomes readable when the child exits (however it exits)."""
        try:
            self._popen.stdin.write(startup_message(sentinel_w))
            self._popen.stdin.flush()
        except BrokenPipeError:  # it died at once; its parent learns how through the sentinel
            pass
        except BaseException:  # interrupted mid-message: this child cannot start, stop it
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

    def exit_description(self, wait_s: float = 0.0) -> str:
        """How the process ended ("exited with code 1", "was killed by SIGKILL"), waiting up to `wait_s` to reap
        it; "is still running" if it has not ended."""
        self.join(wait_s)
        code = self.exitcode
        return "is still running" if code is None else describe_exit(code)

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds for the process to exit (and reap it); True once it has."""
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()

    def close(self) -> None:
        """Release the pipes (closing stdin tells a still-running child to exit); idempotent."""
        if self._popen.stdin is not None and not self._popen.stdin.closed:
            try:
                self._popen.stdin.close()
            except BrokenPipeError:  # the startup message was never read: the child is gone
                pass
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


def describe_exception(e: BaseException) -> str:
    """`Type: message`, then the traceback: the text a child's error carries to its parent (and on to the user)."""
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    return f"{type(e).__name__}: {e}\n{tb}"


def describe_exit(code: int) -> str:
    """An exit code in words: "exited with code 1", or "was killed by SIGKILL" for minus a signal's number."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def _child_env() -> dict[str, str]:
    """The parent's environment, with this vx's folder first on PYTHONPATH when it is not a site-packages folder (a
    source checkout, or one the application put on `sys.path` itself), so that the child imports the vx the parent
    runs. Once started, the child takes the parent's whole `sys.path` from its startup message."""
    vx_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    site_dirs = {os.path.abspath(p) for p in (*site.getsitepackages(), site.getusersitepackages())}
    if vx_root not in site_dirs:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (vx_root, env.get("PYTHONPATH")) if p)
    return env


# How often the watchdog checks that the parent is still the parent, should the stdin pipe stay open after the
# parent died (a process the parent forked without exec holds a copy of its end).
_PARENT_POLL_S = 1.0


def watch_parent(fd: int, name: str, before_exit: Callable[[], None] | None = None) -> None:
    """In the child: exit when the parent dies, even by SIGKILL. A daemon thread `name` waits for end-of-file on `fd`
    (the parent's stdin pipe) and checks once a second that the parent is still the parent; then runs
    `before_exit` (what nobody else is left to clean up) and exits at once."""
    import select
    import threading

    parent_pid = os.getppid()

    def watch() -> None:
        while os.getppid() == parent_pid:
            readable, _, _ = select.select([fd], [], [], _PARENT_POLL_S)
            if readable and not os.read(fd, 4096):
                break
        if before_exit is not None:
            before_exit()
        os._exit(1)

    threading.Thread(target=watch, name=name, daemon=True).start()


def join_parent(read_startup: Callable[[BinaryIO], T], watchdog: str,
                before_exit: Callable[[T], None] | None = None) -> T:
    """In the child, first thing: read the startup message from stdin (`read_startup`), keep the sentinel to this
    process alone (so its exit closes it), take the application's import path (a `package.module:Class` the config
    names imports from the same place), and watch the parent (`watch_parent`; `before_exit(startup)` runs if it
    dies). The startup message must carry `sentinel_fd` and `sys_path`."""
    stdin = sys.stdin.buffer
    startup = read_startup(stdin)
    os.set_inheritable(startup.sentinel_fd, False)  # type: ignore[attr-defined]
    sys.path[:] = startup.sys_path  # type: ignore[attr-defined]
    watch_parent(stdin.fileno(), watchdog, None if before_exit is None else lambda: before_exit(startup))
    return startup


def frame_startup(body: bytes) -> bytes:
    """A startup message as it goes on a child's stdin: an 8-byte big-endian length, then the (msgpack) body."""
    return len(body).to_bytes(8, "big") + body


def read_startup_body(stream: BinaryIO, what: str) -> bytes:
    """The body of exactly one `frame_startup` message from `stream` (the pipe stays open after it); EOFError naming
    `what` ("the engine's stdin") if the parent closed it first."""

    def read_exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = stream.read(n - len(data))
            if not chunk:
                raise EOFError(f"{what} was closed before its startup message was complete")
            data += chunk
        return data

    return read_exactly(int.from_bytes(read_exactly(8), "big"))
