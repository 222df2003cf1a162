"""uvicorn's h11 HTTP/1.1 protocol with a deadline for each request's headers.

uvicorn times out idle keep-alive connections, but nothing else: a client that connects and sends nothing, or
sends half a request line and stops, holds its connection (a socket, a protocol object, an h11 parser) for as
long as it likes, so a few hundred such clients exhaust the server. Here each connection gets `header_timeout`
seconds to deliver a request's headers, counted from the connection (for its first request) or from the first
byte of each later request; then the connection is closed. The body has its own deadline, checked by the
request guard (guard.py) as it reads the body. Headers are also bounded in size, by h11 (16 KiB by default).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


class HeaderTimeoutH11Protocol(H11Protocol):
    """`H11Protocol` that closes a connection whose request headers are not in after `header_timeout` s."""

    def __init__(self, *args: Any, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # the first byte of a new request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._cancel_header_timer()  # the headers are in (h11 left IDLE), or the connection failed

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timeout_expired)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout_expired(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            # No response can be sent before a request line has been parsed: the connection just closes.
            logger.debug("vx serve: closing a connection whose request headers took over %.3g s", self.header_timeout)
            self.transport.close()
