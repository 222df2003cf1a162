"""Clients of the engine core: in the same process, or over ZMQ to a background process.

`InprocClient` steps the engine in the caller's thread. `SyncMPClient` (for `vx.LLM(multiprocess=True)`) and
`AsyncMPClient` (for `AsyncLLM`, on asyncio or trio through anyio) talk to an `EngineCoreProc` in a background
process; see `vx.client.engine_process` for the process, its sockets and how its death is noticed.
"""

from __future__ import annotations

import collections
import itertools
import time
from abc import ABC, abstractmethod
from typing import Any

import anyio
import msgspec
import zmq

from vx.client.engine_process import DEATH_GRACE_S, EngineProcess
from vx.config import VxConfig
from vx.core.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityOutput,
    UtilityRequest,
)
from vx.outputs import EngineStats


class EngineCoreClient(ABC):
    """What the front end needs from an engine core, wherever it runs."""

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs: ...

    @abstractmethod
    def stats(self) -> EngineStats: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    """Runs the EngineCore in the caller's process: `get_output()` is one engine step."""

    def __init__(self, config: VxConfig) -> None:
        from vx.core.engine_core import EngineCore  # the model stack loads only here

        self.engine_core = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(list(request_ids))

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def stats(self) -> EngineStats:
        return self.engine_core.stats()

    def shutdown(self) -> None:
        self.engine_core.shutdown()


def _utility_result(out: UtilityOutput, method: str) -> Any:
    if out.error is not None:
        raise RuntimeError(f"Engine utility call {method!r} failed: {out.error}")
    return out.result


class _EngineProcessClient(EngineCoreClient):
    """What both multiprocess clients do the same way: send requests and aborts to their `EngineProcess`."""

    engine: EngineProcess

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send a validated request to the engine without blocking; `EngineDeadError` once it is dead."""
        self.engine.raise_if_dead()
        self.engine.send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Tell the engine to stop these requests and free their blocks; non-blocking, safe from any thread
        (finalizers included), and a no-op once it is dead (nothing is left to free)."""
        if request_ids and not self.engine.is_dead:
            self.engine.send(EngineCoreRequestType.ABORT, list(request_ids))


class SyncMPClient(_EngineProcessClient):
    """The engine in a background process, for synchronous callers: `get_output()` blocks for the next output.

    The engine process runs with `config` as it is. Any call raises `EngineDeadError` once the engine has died.
    """

    def __init__(self, config: VxConfig) -> None:
        self.engine = EngineProcess(config)
        self._outputs: collections.deque[EngineCoreOutputs] = collections.deque()
        self._call_ids = itertools.count()
        self._poller = zmq.Poller()
        self._poller.register(self.engine.output_socket, zmq.POLLIN)
        self._poller.register(self.engine.sentinel, zmq.POLLIN)

    def get_output(self) -> EngineCoreOutputs:
        """The next engine outputs; blocks until the engine sends some (or dies: `EngineDeadError`)."""
        while True:
            outs = self._outputs.popleft() if self._outputs else self._recv()
            if outs.outputs or outs.input_errors:
                return outs  # LLMEngine raises for the requests the engine refused

    def call_utility(self, method: str, *args: Any) -> Any:
        """Call an engine method by name (e.g. "stats") and return its msgpack-able result."""
        self.engine.raise_if_dead()
        call_id = next(self._call_ids)
        self.engine.send(EngineCoreRequestType.UTILITY, UtilityRequest(call_id=call_id, method=method,
                                                                       args=list(args)))
        while True:
            outs = self._recv()
            uo = outs.utility_output
            if uo is not None and uo.call_id == call_id:
                return _utility_result(uo, method)
            self._outputs.append(outs)  # step outputs that came first wait for get_output()

    def stats(self) -> EngineStats:
        """The engine's `EngineStats`, fetched over the socket."""
        return msgspec.convert(self.call_utility("stats"), EngineStats)

    def _recv(self) -> EngineCoreOutputs:
        """One output message; raises `EngineDeadError` once the engine is gone."""
        engine = self.engine
        exited_at: float | None = None
        while True:
            engine.raise_if_dead()
            if exited_at is None:
                ready = dict(self._poller.poll())
            else:  # the process is gone; its last message (why it died) may still be arriving
                ready = {engine.output_socket: zmq.POLLIN} if engine.output_socket.poll(20) else {}
                if not ready and time.monotonic() - exited_at > DEATH_GRACE_S:
                    engine.mark_exited()
            if engine.output_socket in ready:
                outs = engine.decoder.decode(engine.output_socket.recv())
                engine.check_outputs(outs)
                if outs.engine_error is None:
                    return outs
            elif engine.sentinel in ready:
                exited_at = time.monotonic()

    def shutdown(self) -> None:
        """Stop the engine gracefully (then by force) and release the sockets and the ipc directory."""
        self.engine.close()


class AsyncMPClient(_EngineProcessClient):
    """The engine in a background process, for async callers on any anyio backend (asyncio, trio).

    The constructor blocks (launch + handshake): run it via `anyio.to_thread`. The owner runs two tasks:
    one reader looping over `get_output_async()` and `watch_engine()`, which notices the process exiting
    (even by SIGKILL, which sends nothing) through its sentinel. `add_request`/`abort_requests` are synchronous
    and never block; `abort_requests` works from any thread, finalizers included.
    """

    def __init__(self, config: VxConfig, wait: bool = True) -> None:
        self.engine = EngineProcess(config, wait=wait)  # wait=False: call engine.wait_ready()
        self._call_ids = itertools.count()
        self._utility_waiters: dict[int, list[Any]] = {}  # call_id -> [event, UtilityOutput | None]
        self._reader_scope: anyio.CancelScope | None = None
        self._exited = False

    # ------------------------------------------------------------------------------------------ requests
    def get_output(self) -> EngineCoreOutputs:
        """Not available: this client is async (use `get_output_async`)."""
        raise NotImplementedError("AsyncMPClient is async: use get_output_async().")

    def stats(self) -> EngineStats:
        """Not available: this client is async (use `stats_async`)."""
        raise NotImplementedError("AsyncMPClient is async: use stats_async().")

    def dead_error(self) -> Exception | None:
        """A fresh `EngineDeadError` once the engine is dead, else None."""
        return self.engine.dead_error()

    # ---------------------------------------------------------------------------------------------- async
    async def get_output_async(self) -> EngineCoreOutputs:
        """The next step outputs (or input errors); raises `EngineDeadError` once the engine is gone.

        Only one task may call this at a time. Utility results are handed to their callers on the way.
        """
        engine = self.engine
        sock = engine.output_socket
        fd = sock.getsockopt(zmq.FD)
        while True:
            engine.raise_if_dead()
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                frame = None
            if frame is not None:
                outs = engine.decoder.decode(frame)
                engine.check_outputs(outs)
                if outs.engine_error is not None:
                    self._fail_waiters()
                    continue
                if outs.utility_output is not None:
                    self._resolve(outs.utility_output)
                if outs.outputs or outs.input_errors:
                    return outs
                continue
            # ZMQ's FD is edge-triggered: it signals a change, not a level. Reading EVENTS re-arms it, and a
            # message that arrived meanwhile shows up here instead of waking the wait below.
            if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                continue
            if self._exited:
                await anyio.sleep(0.02)  # the process is gone: poll briefly for its last message
                continue
            with anyio.CancelScope() as scope:
                self._reader_scope = scope  # watch_engine() cancels it to wake us on death
                try:
                    await anyio.wait_readable(fd)
                finally:
                    self._reader_scope = None

    async def watch_engine(self) -> None:
        """Wait for the engine process to exit, then declare it dead (after a grace period for its last words)."""
        await anyio.wait_readable(self.engine.sentinel)
        self._exited = True
        self._wake_reader()
        await anyio.sleep(DEATH_GRACE_S)
        self.engine.mark_exited()
        self._fail_waiters()
        self._wake_reader()

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Call an engine method by name and await its result (needs the reader task running)."""
        self.engine.raise_if_dead()
        call_id = next(self._call_ids)
        waiter: list[Any] = [anyio.Event(), None]
        self._utility_waiters[call_id] = waiter
        try:
            self.engine.send(EngineCoreRequestType.UTILITY, UtilityRequest(call_id=call_id, method=method,
                                                                           args=list(args)))
            await waiter[0].wait()
        finally:
            self._utility_waiters.pop(call_id, None)
        if waiter[1] is None:
            self.engine.raise_if_dead()
            raise RuntimeError(f"Engine utility call {method!r} got no result.")
        return _utility_result(waiter[1], method)

    async def stats_async(self) -> EngineStats:
        """The engine's `EngineStats`, fetched over the socket."""
        return msgspec.convert(await self.call_utility_async("stats"), EngineStats)

    def _resolve(self, out: UtilityOutput) -> None:
        waiter = self._utility_waiters.get(out.call_id)
        if waiter is not None:
            waiter[1] = out
            waiter[0].set()

    def _fail_waiters(self) -> None:
        for waiter in list(self._utility_waiters.values()):
            waiter[0].set()  # no result: the caller raises the dead error

    def _wake_reader(self) -> None:
        if self._reader_scope is not None:
            self._reader_scope.cancel()

    def shutdown(self) -> None:
        """Blocking: stop the engine gracefully and release everything. Stop the reader and watcher first."""
        self.engine.close()
