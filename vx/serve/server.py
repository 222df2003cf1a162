"""Running an app from `build_app` with uvicorn, as `vx serve` does: header timeouts, a graceful drain on
SIGTERM/SIGINT, and an exit when the engine dies.

- Each connection speaks HTTP/1.1 through `HeaderTimeoutH11Protocol` (`options.header_timeout`).
- SIGTERM or SIGINT: the server stops accepting connections, answers 503 to requests that still arrive on open
  ones, and lets running requests finish for `options.shutdown_grace_period` seconds. Then each request left is
  ended by its guard (an error event and `data: [DONE]` for a stream), the engine is shut down, and the process
  exits 0. A second SIGINT skips the wait.
- The engine dies (`llm.errored`): the server logs it and drains the same way (open streams have already had
  their error event), then exits 1 so that a supervisor restarts it, unless `options.keep_alive_on_engine_death`
  keeps it up, answering 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import socket
import threading
from typing import Any, Iterator

import uvicorn
from fastapi import FastAPI

from vx.serve.http_protocol import HeaderTimeoutH11Protocol
from vx.serve.state import ServerState

logger = logging.getLogger(__name__)

_ENGINE_DEATH_GRACE_S = 1.0  # every request has already failed: this only lets the error responses go out
_STOP_WAIT_S = 3.0  # after requests were told to stop, how long they get to send their last bytes


class VxServer(uvicorn.Server):
    """`uvicorn.Server` with vx's drain, engine-death exit and signal handling; `exit_code` once it returns."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.vx = state
        self.exit_code = 0
        self.engine_died = False

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick (every 0.1 s), which also watches the engine."""
        if not self.engine_died and getattr(self.vx.llm, "errored", False):
            self.engine_died = True
            error = self.vx.llm.dead_error
            if self.vx.options.keep_alive_on_engine_death:
                logger.error("vx serve: the engine died (%s); serving 503s (--keep-alive-on-engine-death)", error)
            else:
                logger.error("vx serve: the engine died (%s); draining and exiting with code 1 (a supervisor "
                             "should restart the server; --keep-alive-on-engine-death keeps it up)", error)
                self.exit_code = 1
                self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Stop accepting, let running requests finish (the grace period), end those left, stop the engine."""
        inflight = self.vx.inflight
        inflight.draining = True  # what still arrives on open connections gets 503
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()  # idle ones close now, busy ones after their response
        grace = _ENGINE_DEATH_GRACE_S if self.engine_died else self.vx.options.shutdown_grace_period
        if self.server_state.tasks:
            logger.info("vx serve: stopping; %d request(s) running get up to %.3g s to finish",
                        len(self.server_state.tasks), grace)
        if not await self._requests_done(grace):
            ended = inflight.stop_all()
            logger.warning("vx serve: %d request(s) still running after %.3g s: each ends with an error (503)",
                           ended, grace)
            if not await self._requests_done(_STOP_WAIT_S):
                # Only a response whose client reads nothing can still be here.
                for task in self.server_state.tasks:
                    task.cancel()
        if not self.force_exit:
            await self.lifespan.shutdown()

    async def _requests_done(self, timeout: float) -> bool:
        """Wait up to `timeout` s for every request task to end; False if some still run."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.server_state.tasks and not self.force_exit:
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, without re-raising the signal at the end: a requested stop that drained is exit code 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def run(app: FastAPI, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
        **uvicorn_kwargs: Any) -> int:
    """Serve `app` (from `build_app`) until SIGTERM/SIGINT or the engine's death; returns the exit code."""
    state: ServerState = app.state.vx
    protocol = functools.partial(HeaderTimeoutH11Protocol, header_timeout=state.options.header_timeout)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,  # type: ignore[arg-type]
                            lifespan="on", **uvicorn_kwargs)
    server = VxServer(config, state)
    server.run()
    return server.exit_code
