"""The HTTP requests one app is handling: counted for the concurrency limit, and ended when the server stops.

Each request runs inside its own cancel scope, registered here by the request guard. A shutdown first sets
`draining` (new requests get 503), waits for the running ones, then calls `stop_all()`: every scope is cancelled
and the guard ends each response properly (an error event and `[DONE]` for a stream, 503 otherwise).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import anyio


class InFlight:
    """The running requests of one app (no global state: two apps never share it)."""

    def __init__(self) -> None:
        self._scopes: dict[anyio.CancelScope, bool] = {}  # scope -> is a generation request
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

    @contextlib.contextmanager
    def track(self, generation: bool) -> Iterator[anyio.CancelScope]:
        """Run a request inside the returned cancel scope, counted while it runs."""
        with anyio.CancelScope() as scope:
            self._scopes[scope] = generation
            try:
                yield scope
            finally:
                del self._scopes[scope]

    def stop_all(self) -> int:
        """Cancel every running request (each is then ended by its guard); returns how many there were."""
        self.stopping = True
        scopes = list(self._scopes)
        for scope in scopes:
            scope.cancel()
        return len(scopes)
