"""The background engine process as the client sees it: launch, handshake, sockets, death, shutdown.

Both multiprocess clients (`SyncMPClient`, `AsyncMPClient`) own one `EngineProcess`. The client binds two ZMQ
sockets on `ipc://` paths inside a private temporary directory (mode 0700) and launches the engine process
(`EngineChild`: `python -m vx.core.engine_main`, never a re-import of the application's main module), which
connects to them: PUSH (client) -> PULL (engine) for requests, PUSH (engine) -> PULL (client) for outputs.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from typing import Any

import zmq

from vx.client.engine_child import EngineChild
from vx.config import VxConfig, encode_config
from vx.core.protocol import EngineCoreOutputs, EngineCoreReady, EngineCoreRequestType, OutputDecoder, encode_input
from vx.errors import EngineDeadError
from vx.module_process import describe_exit

logger = logging.getLogger(__name__)

# After the process is seen gone, how long its last message (the error it died of) may take to arrive.
DEATH_GRACE_S = 0.5
_SHUTDOWN_TIMEOUT_S = 5.0


class EngineCoreError(RuntimeError):
    """The error the engine process reported before it exited; the text ends with the engine's traceback."""


class EngineProcess:
    """One engine process and the client's end of its sockets.

    The constructor blocks until the engine's ready handshake (run it in a worker thread from async code),
    unless `wait=False`: then the caller does other start-up work while the engine boots, and calls
    `wait_ready()`.
    `send` is non-blocking and safe from any thread, even re-entrantly from a finalizer; the output socket
    belongs to one reader. Death is recorded once (`mark_dead`); `close()` stops everything and is idempotent.
    """

    def __init__(self, config: VxConfig, startup_timeout: float = 600.0, wait: bool = True) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="vx-")
        os.chmod(self.ipc_dir, 0o700)  # only this user may connect to the engine
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.output_socket = self.ctx.socket(zmq.PULL)
        for sock in (self.input_socket, self.output_socket):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # no limit: a send must never block or be refused while connected
            sock.setsockopt(zmq.RCVHWM, 0)
        input_addr = f"ipc://{os.path.join(self.ipc_dir, 'input')}"
        output_addr = f"ipc://{os.path.join(self.ipc_dir, 'output')}"
        self.input_socket.bind(input_addr)
        self.output_socket.bind(output_addr)
        self.decoder = OutputDecoder()
        self._send_lock = threading.Lock()
        self._pending_sends: collections.deque[list[bytes]] = collections.deque()
        self._dead: tuple[str, str | None] | None = None
        self.closing = False
        self.crashed = False  # died on its own (crash, kill) rather than by `close()`
        self._closed = False
        self.exitcode: int | None = None  # the process's exit code, once close() has reaped it

        # The config goes whole, as msgpack bytes: the engine uses it as resolved here, so no field can be lost on
        # the way.
        try:
            self.proc = EngineChild(encode_config(config), input_addr, output_addr, self.ipc_dir)
        except BaseException:
            _cleanup(None, self.ctx, (self.input_socket, self.output_socket), self.ipc_dir)
            raise
        # Runs on close(), on garbage collection, or at interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _cleanup, self.proc, self.ctx,
                                           (self.input_socket, self.output_socket), self.ipc_dir)
        self.startup_timeout = startup_timeout
        self.ready: EngineCoreReady | None = None
        if wait:
            self.wait_ready()

    def wait_ready(self) -> EngineCoreReady:
        """Block until the engine's ready handshake (once); on failure everything is released and it raises."""
        if self.ready is None:
            try:
                self.ready = self._wait_ready(self.startup_timeout)
            except BaseException:
                self._finalizer()
                raise
        return self.ready

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the engine process exits (however it exits)."""
        return self.proc.sentinel

    def _wait_ready(self, timeout: float) -> EngineCoreReady:
        poller = zmq.Poller()
        poller.register(self.output_socket, zmq.POLLIN)
        poller.register(self.sentinel, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        exited_at: float | None = None
        while True:
            now = time.monotonic()
            if exited_at is not None and now - exited_at > DEATH_GRACE_S:
                raise EngineDeadError(
                    f"The vx engine failed to start: {self.exit_description()} before it could report why (see "
                    "its output above).")
            if now > deadline:
                raise EngineDeadError(f"The vx engine did not start within {timeout:.0f} s.")
            if exited_at is None:
                events = dict(poller.poll(timeout=1000))
            else:  # the sentinel stays readable now: wait on the socket alone
                events = {self.output_socket: zmq.POLLIN} if self.output_socket.poll(50) else {}
            if self.output_socket in events:
                ready = self.decoder.decode_ready(self.output_socket.recv())
                if ready.error is not None:
                    raise EngineDeadError(f"The vx engine failed to start: {_first_line(ready.error)}") \
                        from EngineCoreError(ready.error)
                return ready
            if self.sentinel in events and exited_at is None:
                exited_at = time.monotonic()  # its handshake (with the error) may still be on the way

    # ------------------------------------------------------------------------------------------------ send
    def send(self, request_type: EngineCoreRequestType, payload: Any = None) -> None:
        """Queue one message for the engine without blocking; dropped silently once the engine is gone.

        Whoever holds the send lock sends everything queued, in order; a caller that finds it taken (another
        thread, or a finalizer run by the holder's own thread in the middle of a send) leaves its message
        for the holder, who checks again after releasing.
        """
        self._pending_sends.append(encode_input(request_type, payload))
        while self._pending_sends:
            if not self._send_lock.acquire(blocking=False):
                return
            try:
                while self._pending_sends:
                    frames = self._pending_sends.popleft()
                    if self._closed:
                        continue
                    try:
                        self.input_socket.send_multipart(frames, flags=zmq.NOBLOCK)
                    except zmq.ZMQError:  # EAGAIN: no engine connected any more; death is detected elsewhere
                        pass
            finally:
                self._send_lock.release()

    # ----------------------------------------------------------------------------------------------- death
    def check_outputs(self, outputs: EngineCoreOutputs) -> None:
        """Record the engine's death when `outputs` is its last message (it carries the engine's error)."""
        if outputs.engine_error is not None:
            self.mark_dead(f"The vx engine died: {_first_line(outputs.engine_error)}", outputs.engine_error)

    def mark_dead(self, message: str, cause: str | None = None) -> None:
        """Record that the engine is gone (the first reason wins); logged as an error unless shutting down."""
        if self._dead is not None:
            return
        self._dead = (message, cause)
        self.crashed = not self.closing
        if self.crashed:
            logger.error("%s", message if cause is None else f"{message}\n{cause}")

    def mark_exited(self) -> None:
        """Record death by process exit, when no error message came first."""
        if self.closing:
            self.mark_dead("The vx engine was shut down.")
        else:
            self.mark_dead(f"The vx engine died: {self.exit_description()}.")

    @property
    def is_dead(self) -> bool:
        """True once the engine is known to be gone (died, killed, or shut down)."""
        return self._dead is not None

    def dead_error(self) -> EngineDeadError | None:
        """A fresh `EngineDeadError` (with the engine's error as `__cause__`) once dead, else None."""
        if self._dead is None:
            return None
        message, cause = self._dead
        err = EngineDeadError(message)
        if cause is not None:
            err.__cause__ = EngineCoreError(cause)
        return err

    def raise_if_dead(self) -> None:
        """Raise `EngineDeadError` once the engine is gone; every client call starts with this."""
        err = self.dead_error()
        if err is not None:
            raise err

    def exit_description(self) -> str:
        """How the process ended, in words (exit code or signal name), for error messages."""
        code = self.proc.exitcode
        if code is None:
            return "the engine process stopped responding"
        return f"the engine process {describe_exit(code)}"

    # -------------------------------------------------------------------------------------------- shutdown
    def close(self, timeout: float = _SHUTDOWN_TIMEOUT_S) -> None:
        """Ask the engine to stop, wait for it (then terminate, then kill), close the sockets, remove the ipc dir.

        Blocks up to `timeout` (+ a few seconds if the engine must be killed); call it from a worker thread in
        async code, after the tasks that use the sockets have stopped.
        """
        if self._closed:
            return
        self.closing = True
        if self.proc.is_alive():
            self.send(EngineCoreRequestType.SHUTDOWN)
            self.proc.join(timeout)
        self.mark_exited()
        self.exitcode = self.proc.exitcode
        with self._send_lock:  # no send may touch the sockets while they close
            self._closed = True
        self._finalizer()
        self.proc.close()


def _cleanup(proc: EngineChild | None, ctx: zmq.Context, sockets: tuple[zmq.Socket, ...], ipc_dir: str) -> None:
    """Stop the process if it still runs, and release its pipes, the sockets and the ipc directory (also from
    GC/atexit)."""
    if proc is not None:
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        proc.close()
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()
    shutil.rmtree(ipc_dir, ignore_errors=True)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unknown error"
