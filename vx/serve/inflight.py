"""The HTTP requests one app is handling: counted for the concurrency limits, and ended when the server stops.

Each request runs inside its own cancel scope, registered here by the request guard, with the client it came from
(`None` for one that no per-client share applies to: in-process requests). The guard counts, per client, the
generation requests in flight and the request bodies that are slow to arrive, so that one client cannot hold every
slot. A body is slow once it has been arriving for `slow_body_s`: a working client's bodies arrive within
milliseconds, but a burst of its requests may have every body arriving at once, so only time tells a slow
sender apart. The time is the client's: a busy server's event loop gets to a body late, so how late the loop has
run since the body began (`watch_loop`) is taken off its time, and a storm of working clients on a busy server is
not taken for slow senders.

A shutdown first sets `draining` (new requests get 503), waits for the running ones, then calls `stop_all()`:
every scope is cancelled and the guard ends each response properly (an error event and `[DONE]` for a stream,
503 otherwise).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import Counter, deque
from typing import Iterator

import anyio

SLOW_BODY_S = 1.0  # a body still arriving after this long, on its client's time, is a slow one
LOOP_TICK_S = 0.1  # how often `watch_loop` looks at the event loop's lateness
LATE_TICKS_KEPT_S = 120.0  # longer than any body may take to arrive (--body-timeout)


class InFlight:
    """The running requests of one app (no global state: two apps never share it)."""

    def __init__(self, slow_body_s: float = SLOW_BODY_S) -> None:
        self.slow_body_s = slow_body_s
        self._scopes: dict[anyio.CancelScope, bool] = {}  # scope -> is a generation request
        self._generating: Counter[str] = Counter()  # client -> its generation requests in flight
        self._bodies: dict[str, dict[int, float]] = {}  # client -> {body: when it began to arrive}
        self._body_ids = itertools.count()
        self._late_ticks: deque[tuple[float, float]] = deque()  # (when, how late) of the loop's recent late ticks
        self.draining = False  # the server is stopping: refuse new requests
        self.stopping = False  # the grace period is over: running requests are being ended

    @property
    def total(self) -> int:
        """Requests of any kind now running."""
        return len(self._scopes)

    @property
    def generating(self) -> int:
        """Generation requests (completions, chat, responses, embeddings) now running: what the concurrency limit
        counts."""
        return sum(self._scopes.values())

    def generating_for(self, client: str) -> int:
        """Generation requests of `client` now running (their bodies still arriving, or being answered)."""
        return self._generating[client]

    def lateness_since(self, began: float) -> float:
        """How late (s) the event loop has run its timers since `began` (0 unwatched): server time, not the client's."""
        now = time.monotonic()
        while self._late_ticks and self._late_ticks[0][0] < now - LATE_TICKS_KEPT_S:
            self._late_ticks.popleft()
        return sum(lag for when, lag in self._late_ticks if when >= began)

    async def watch_loop(self) -> None:
        """Note how late the event loop runs (until cancelled): the server's own delay in reading a body."""
        while True:
            start = time.monotonic()
            await anyio.sleep(LOOP_TICK_S)
            now = time.monotonic()
            if now - start > 2 * LOOP_TICK_S:
                self._late_ticks.append((now, now - start - LOOP_TICK_S))

    def slow_bodies_for(self, client: str) -> int:
        """Request bodies of `client` that have been arriving for longer than `slow_body_s` on the client's time
        (the event loop's lateness since each began taken off)."""
        now = time.monotonic()
        return sum(now - began - self.lateness_since(began) > self.slow_body_s
                   for began in self._bodies.get(client, {}).values())

    @contextlib.contextmanager
    def track(self, generation: bool, client: str | None = None) -> Iterator[anyio.CancelScope]:
        """Run a request of `client` inside the returned cancel scope, counted while it runs."""
        with anyio.CancelScope() as scope, _counted(self._generating, client if generation else None):
            self._scopes[scope] = generation
            try:
                yield scope
            finally:
                del self._scopes[scope]

    @contextlib.contextmanager
    def receiving_body(self, client: str | None) -> Iterator[None]:
        """Note a body of `client` (none for None) as arriving while the block runs."""
        if client is None:
            yield
            return
        body, bodies = next(self._body_ids), self._bodies.setdefault(client, {})
        bodies[body] = time.monotonic()
        try:
            yield
        finally:
            del bodies[body]
            if not bodies:
                del self._bodies[client]

    def stop_all(self) -> int:
        """Cancel every running request (each is then ended by its guard); returns how many there were."""
        self.stopping = True
        scopes = list(self._scopes)
        for scope in scopes:
            scope.cancel()
        return len(scopes)


@contextlib.contextmanager
def _counted(counts: Counter[str], client: str | None) -> Iterator[None]:
    """One more for `client` (none counted for None) while the block runs; a client at zero is forgotten."""
    if client is None:
        yield
        return
    counts[client] += 1
    try:
        yield
    finally:
        counts[client] -= 1
        if counts[client] <= 0:
            del counts[client]
