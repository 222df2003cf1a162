"""Fair shares of one engine step: the token budget and the batch's seats split among the clients that want them.

A client is a request group (`Request.group`: the n children of one `n > 1` request share one; any other request is
its own). Without shares, running requests take the budget in admission order and waiting ones get seats only as
running ones end, so one heavy client (a fan-out filling every seat, a long prompt taking every token) makes every
other stream wait for it. With them:
- tokens: each client gets at most its max-min fair part of the budget (`water_fill`): a client that needs less
  than an equal part (a decoding stream: one token) gets all it needs, the rest is split evenly among the others;
- seats: when the batch is full and a client waits with fewer seats than an equal part, the client holding the most
  seats above its part gives one back (`seat_claims`; the request is preempted and resumes later from the prefix
  cache).
With a single client both are no-ops: the schedule is exactly first come, first served.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping, Sequence


def water_fill(demands: Mapping[str, int], capacity: int) -> dict[str, int]:
    """Max-min fair allotment of `capacity` among `demands` (client -> wanted units): no client gets more than it
    wants, and none that gets less than it wants gets less than any other. Units left by rounding go to the
    largest demands. The allotments add up to min(capacity, sum of demands)."""
    alloc: dict[str, int] = {}
    left = capacity
    order = sorted(demands, key=lambda client: demands[client])
    for i, client in enumerate(order):
        give = min(demands[client], left // (len(order) - i))
        alloc[client] = give
        left -= give
    for client in reversed(order):
        if left <= 0:
            break
        extra = min(demands[client] - alloc[client], left)
        alloc[client] += extra
        left -= extra
    return alloc


class TokenShares:
    """What each client may still be given this step (clients not named get nothing while shares apply)."""

    def __init__(self, allotment: dict[str, int]) -> None:
        self._left = allotment

    def left(self, client: str) -> int:
        return self._left.get(client, 0)

    def spend(self, client: str, tokens: int) -> None:
        self._left[client] = self.left(client) - tokens


def token_shares(demands: Mapping[str, int], budget: int) -> TokenShares | None:
    """The step's token shares, or None (no limit) when fewer than two clients want tokens."""
    wanting = {client: d for client, d in demands.items() if d > 0}
    if len(wanting) < 2:
        return None
    return TokenShares(water_fill(wanting, budget))


def seat_claims(running_groups: Sequence[str], waiting_groups: Iterable[str], max_seats: int,
                ) -> list[tuple[int, int]]:
    """Which seats change hands when the batch is full: (index in `running_groups` of the request that gives its
    seat back, position in `waiting_groups` of the request that takes it).

    `running_groups` is the running requests' clients in admission order; `waiting_groups` the clients of the
    waiting requests that could start now, in queue order. A waiting client claims a seat while it holds fewer
    than an equal part of `max_seats` among the clients present; the seat comes from the newest request of the
    client holding the most seats, if that client holds more than its part.
    """
    if len(running_groups) < max_seats:
        return []
    seats = Counter(running_groups)
    given_back: set[int] = set()
    claims: list[tuple[int, int]] = []
    for position, client in enumerate(waiting_groups):
        present = len(seats) + (client not in seats)
        part = max(1, max_seats // present)
        if seats[client] >= part:
            continue
        holder, held = max(seats.items(), key=lambda item: item[1])
        if held <= part:
            break  # nobody holds more than its part: the batch is shared fairly already
        index = max(i for i, g in enumerate(running_groups) if g == holder and i not in given_back)
        given_back.add(index)
        seats[holder] -= 1
        if not seats[holder]:
            del seats[holder]
        seats[client] += 1
        claims.append((index, position))
    return claims
