"""The scheduler's waiting queue, in one of two orders: first come first served, or by priority.

Both queues keep preempted requests ahead of their peers: FCFS puts them back at the front, and the
priority queue orders by (priority, arrival time), which a preempted request keeps.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from vx.config import SCHEDULING_POLICIES
from vx.core.request import Request


class RequestQueue(Protocol):
    """What the scheduler needs of its waiting queue."""

    def add(self, request: Request) -> None:
        """Queue a new request."""

    def prepend(self, request: Request) -> None:
        """Put back a preempted request, ahead of the requests that came after it."""

    def peek(self) -> Request:
        """The request to admit next (IndexError when empty)."""

    def pop(self) -> Request:
        """Remove and return `peek()`."""

    def remove(self, request: Request) -> None:
        """Remove a queued request (abort)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """Arrival order; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Lowest `priority` value first (as in vLLM), then earliest arrival; a heap, so O(log n) per request.

    Removal is lazy: an aborted request is only marked, and skipped when it reaches the top.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._removed: set[int] = set()  # id() of requests removed but still in the heap
        self._count = 0  # tie-breaker: never compare Requests

    def add(self, request: Request) -> None:
        self._count += 1
        heapq.heappush(self._heap, (request.priority, request.arrival_time, self._count, request))

    def prepend(self, request: Request) -> None:
        self.add(request)  # its (priority, arrival) already puts it ahead of later arrivals

    def _drop_removed(self) -> None:
        while self._heap and id(self._heap[0][3]) in self._removed:
            self._removed.discard(id(heapq.heappop(self._heap)[3]))

    def peek(self) -> Request:
        self._drop_removed()
        return self._heap[0][3]

    def pop(self) -> Request:
        self._drop_removed()
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        if id(request) in self._removed or not any(entry[3] is request for entry in self._heap):
            raise ValueError(f"{request!r} is not queued")
        self._removed.add(id(request))

    def __len__(self) -> int:
        return len(self._heap) - len(self._removed)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap) if id(entry[3]) not in self._removed)


def make_request_queue(policy: str) -> RequestQueue:
    """The waiting queue for a scheduling policy ("fcfs" or "priority")."""
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {policy!r}.")
