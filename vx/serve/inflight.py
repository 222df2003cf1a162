"""The HTTP requests one app is handling: counted for the concurrency limits, and ended when the server stops.

Each request runs inside its own cancel scope, registered here by the request guard, with the client it came from
(`None` for one that no per-client share applies to: in-process requests). The guard counts, per client, the
generation requests in flight and the request bodies still arriving, so that one client cannot hold every slot.
A shutdown first sets `draining` (new requests get 503), waits for the running ones, then calls `stop_all()`:
every scope is cancelled and the guard ends each response properly (an error event and `[DONE]` for a stream,
503 otherwise).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import anyio


class InFlight:
    """The running requests of one app (no global state: two apps never share it)."""

    def __init__(self) -> None:
        self._scopes: dict[anyio.CancelScope, bool] = {}  # scope -> is a generation request
        self._generating: Counter[str] = Counter()  # client -> its generation requests in flight
        self._bodies: Counter[str] = Counter()  # client -> its request bodies still arriving
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

    def bodies_for(self, client: str) -> int:
        """Request bodies of `client` still arriving."""
        return self._bodies[client]

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
        """Count a body of `client` as arriving while the block runs."""
        with _counted(self._bodies, client):
            yield

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
