"""Next-token masks of constrained requests, filled on mask threads off the engine's step.

A request's mask for its next position is started as soon as its previous token is accepted (or its grammar is
ready), on a thread (xgrammar releases the GIL while it fills), so it is computed while the engine sends outputs,
plans the step and runs other requests' forward passes. The scheduler waits for the masks it expects to be quick
at most `budget_s` a step, and leaves a request whose mask is not ready out of that step: one costly grammar slows
only its own request. A request whose masks take longer than the budget moves to a separate "slow lane" of threads,
so that it never queues ahead of quick masks; one whose masks keep missing the budget is failed by its owner.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

# A request fails once this many of its masks took longer than the budget (the first may be a cold cache).
MAX_SLOW_MASKS = 3


@dataclass
class MaskJob:
    """One request's mask for its next position: its future gives the int32 bitmask row."""

    future: concurrent.futures.Future | None = None
    started: float | None = None  # set by the mask thread when the fill begins (None while it queues)
    seconds: float | None = None  # how long the fill took, once done
    counted_slow: bool = False  # already counted against its request as slow

    def running_for(self, now: float) -> float:
        """Seconds since the fill began (0 while it waits for a thread)."""
        if self.seconds is not None:
            return self.seconds
        return now - self.started if self.started is not None else 0.0

    def done(self) -> bool:
        return self.future is not None and self.future.done()


class MaskFiller:
    """Two pools of mask threads (quick lane, slow lane), each `workers` threads."""

    def __init__(self, workers: int, budget_s: float) -> None:
        self.budget_s = budget_s
        self._quick = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="vx-grammar-mask")
        self._slow = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="vx-grammar-mask-slow")

    def start(self, fill: Callable[[], np.ndarray], slow: bool) -> MaskJob:
        """Run `fill()` (which returns the bitmask row) on a mask thread of the quick or the slow lane."""
        job = MaskJob()

        def run() -> np.ndarray:
            job.started = started = time.monotonic()
            try:
                return fill()
            finally:
                job.seconds = time.monotonic() - started

        job.future = (self._slow if slow else self._quick).submit(run)
        return job

    def wait(self, jobs: list[MaskJob]) -> None:
        """Block until every job is done or `budget_s` has passed."""
        pending = [j.future for j in jobs if j.future is not None and not j.future.done()]
        if pending:
            concurrent.futures.wait(pending, timeout=self.budget_s)

    def is_slow(self, job: MaskJob, now: float) -> bool:
        """Whether the fill took (or has been running for) longer than the budget."""
        return job.running_for(now) > self.budget_s

    def shutdown(self) -> None:
        """Drop queued fills; running ones end on their own (their threads are not waited for)."""
        for pool in (self._quick, self._slow):
            pool.shutdown(wait=False, cancel_futures=True)


def allowed_tokens(row: np.ndarray) -> np.ndarray:
    """The token ids whose bit is set in an int32 bitmask row."""
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits)


def time_fills(matcher: Any, fill: Callable[[Any], np.ndarray], steps: int, limit_s: float = float("inf"),
               seed: int = 0) -> float:
    """The longest of `steps` mask fills along one path through the grammar (each step accepts an allowed token
    chosen by a seeded generator), stopping at the first that takes longer than `limit_s`: what a compile measures
    before a request may use the grammar."""
    rng = np.random.default_rng(seed)
    longest = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        row = fill(matcher)
        longest = max(longest, time.perf_counter() - t0)
        if longest > limit_s:
            break
        allowed = allowed_tokens(row)
        if not len(allowed) or not matcher.accept_token(int(rng.choice(allowed))) or matcher.is_terminated():
            break
    return longest
