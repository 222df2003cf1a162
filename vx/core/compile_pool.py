"""A pool of compile threads with a deadline per compile, for grammars that may take unboundedly long to compile.

A Python thread cannot be stopped. So a compile that runs past its deadline fails its future at once, and its thread
runs on in the background with its result discarded ("abandoned"). Abandoned threads count against a fixed ceiling
of `workers + max_abandoned` compile threads: while slow compiles run on, fewer new ones start, and no more threads
than that ever exist, however many slow grammars arrive. A compile that cannot even start within the deadline
(every thread busy) fails too, so that no request waits forever behind them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable


class CompileTimeoutError(TimeoutError):
    """A compile ran longer than the pool's deadline: its request's input is too costly to compile."""


class CompileQueueTimeoutError(RuntimeError):
    """A compile could not start within the deadline because every compile thread was busy."""


@dataclass(eq=False)
class _Job:
    key: Hashable
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    submitted: float = field(default_factory=time.monotonic)
    dispatched: bool = False  # a thread took it (it may still be setting up, before its clock starts)
    started: float | None = None  # when its compile began: its deadline runs from here
    abandoned: bool = False  # failed by its deadline while its thread runs on


class CompilePool:
    """Runs `compile_fn(key)` on daemon threads, at most `workers` at once; `expire()` enforces the deadlines.

    `setup_fn` runs in the compile thread before each compile, off the clock (e.g. building the compiler once).
    The owner calls `expire()` regularly (the engine does, every step in which a request waits for its grammar);
    futures fail with `CompileTimeoutError` (ran too long) or `CompileQueueTimeoutError` (never started).
    """

    def __init__(self, compile_fn: Callable[[Hashable], Any], workers: int, timeout_s: float,
                 max_abandoned: int | None = None, setup_fn: Callable[[], Any] | None = None) -> None:
        self.compile_fn = compile_fn
        self.setup_fn = setup_fn
        self.workers = workers
        self.timeout_s = timeout_s
        self.max_abandoned = workers if max_abandoned is None else max_abandoned
        self._lock = threading.Lock()
        self._queue: collections.deque[_Job] = collections.deque()
        self._active: set[_Job] = set()  # dispatched, not abandoned, not finished
        self._abandoned: set[_Job] = set()  # past their deadline, their threads still running
        self._closed = False

    @property
    def num_threads(self) -> int:
        """Compile threads alive now (running or abandoned)."""
        with self._lock:
            return len(self._active) + len(self._abandoned)

    @property
    def num_abandoned(self) -> int:
        """Compiles past their deadline whose threads still run."""
        with self._lock:
            return len(self._abandoned)

    def submit(self, key: Hashable) -> concurrent.futures.Future:
        """Queue a compile of `key`; its future gets the compiled result or the compile's exception."""
        job = _Job(key)
        with self._lock:
            if self._closed:
                raise RuntimeError("the compile pool is shut down")
            self._queue.append(job)
            self._dispatch()
        return job.future

    def expire(self) -> None:
        """Fail the compiles past their deadline: running ones are abandoned, queued ones dropped."""
        now = time.monotonic()
        with self._lock:
            for job in [j for j in self._active if j.started is not None and now - j.started > self.timeout_s]:
                self._active.discard(job)
                self._abandoned.add(job)
                job.abandoned = True
                job.future.set_exception(CompileTimeoutError(
                    f"compiling took longer than {self.timeout_s:g} s"))
            self._dispatch()  # into the places just freed, before a queued compile is judged as never started
            while self._queue and now - self._queue[0].submitted > self.timeout_s:
                job = self._queue.popleft()
                job.future.set_exception(CompileQueueTimeoutError(
                    f"no compile could start within {self.timeout_s:g} s: all {self.workers} compile threads were "
                    f"busy ({len(self._abandoned)} of them with compiles that timed out)"))
            self._dispatch()

    def shutdown(self) -> None:
        """Cancel what is queued; running compiles finish (or not) on their daemon threads, unobserved."""
        with self._lock:
            self._closed = True
            while self._queue:
                self._queue.popleft().future.cancel()

    # ----------------------------------------------------------------------------------------------- internals
    def _dispatch(self) -> None:
        """Start queued jobs while a worker is free and the thread ceiling allows (holding the lock)."""
        while (self._queue and not self._closed and len(self._active) < self.workers
               and len(self._active) + len(self._abandoned) < self.workers + self.max_abandoned):
            job = self._queue.popleft()
            if not job.future.set_running_or_notify_cancel():
                continue
            job.dispatched = True
            self._active.add(job)
            threading.Thread(target=self._run, args=(job,), name="vx-grammar", daemon=True).start()

    def _run(self, job: _Job) -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            if self.setup_fn is not None:
                self.setup_fn()
            job.started = time.monotonic()
            result = self.compile_fn(job.key)
        except BaseException as e:  # noqa: BLE001 - any failure belongs to the job's future
            error = e
        with self._lock:
            if job.abandoned:
                self._abandoned.discard(job)  # its future failed at the deadline: the result is dropped
            else:
                self._active.discard(job)
                if error is None:
                    job.future.set_result(result)
                else:
                    job.future.set_exception(error)
            self._dispatch()
