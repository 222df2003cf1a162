"""The background compiler: builds the decode-graph sizes queued to it one at a time, each once the engine is idle.

A compile is mostly Python and holds the GIL, so one that ran beside busy steps would slow them for its whole
duration; the steps go first, and while a compile runs the GIL changes hands more often (docs/decode_graphs.md).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable

# The interpreter's GIL switch interval while a graph compiles in the background (default 5 ms).
COMPILE_SWITCH_INTERVAL_S = 1e-4
IDLE_POLL_S = 0.05  # how often a queued compile asks whether the engine is idle


class CompilerThread:
    """Compiles the sizes submitted to it one at a time, each once `ready()` says so (the engine is idle), each in
    a thread of its own that ends after it.

    A thread per compile, and none kept waiting after one, because a thread that has run torch's parallel ops keeps
    its own OpenMP team while it lives, and with more OpenMP threads than cores libgomp stops spinning between
    parallel regions: every region of every later step would then pay a sleeping thread's wake-up (see
    `vx.platform.prefer_openmp_wait_policy`). A thread waiting for `ready()` has run none yet.
    """

    def __init__(self, ready: Callable[[], bool] = lambda: True) -> None:
        self._ready = ready
        self._lock = threading.Lock()
        # (size, the compile to run); nothing of it is kept once run, so an idle compiler holds no model alive.
        self._pending: deque[tuple[int, Callable[[int], None]]] = deque()
        self._stopped = False
        self.thread: threading.Thread | None = None

    @property
    def stopped(self) -> bool:
        return self._stopped

    def submit(self, size: int, compile_fn: Callable[[int], None]) -> None:
        """Queue `compile_fn(size)`, starting a thread if none runs; ignored once stopped."""
        with self._lock:
            if self._stopped:
                return
            self._pending.append((size, compile_fn))
            if self.thread is None:
                self._start_locked()

    def stop(self, wait: bool = False) -> None:
        """Drop the queued sizes; with `wait`, wait for the compile in progress (if any) to end."""
        with self._lock:
            self._stopped = True
            self._pending.clear()
            thread = self.thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()

    def _start_locked(self) -> None:
        self.thread = threading.Thread(target=self._run_one, name="vx-decode-compile", daemon=True)
        self.thread.start()

    def _next(self) -> tuple[int, Callable[[int], None]] | None:
        """The next compile, once the engine is idle; None (this thread ends) when stopped or nothing is queued."""
        while True:
            with self._lock:
                if self._stopped or not self._pending:
                    self.thread = None
                    return None
                if self._ready():
                    return self._pending.popleft()
            time.sleep(IDLE_POLL_S)

    def _run_one(self) -> None:
        job = self._next()
        if job is None:
            return
        size, compile_fn = job
        # While this thread compiles (mostly Python), every torch op of an eager step that releases the GIL waits up
        # to a whole switch interval (5 ms) to get it back: hundreds a step. A short interval for the compile's
        # duration keeps a step that comes meanwhile near its speed.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(COMPILE_SWITCH_INTERVAL_S)
        try:
            compile_fn(size)
        finally:
            sys.setswitchinterval(interval)
            with self._lock:
                if self._pending and not self._stopped:
                    self._start_locked()  # the next size gets a fresh thread, with no OpenMP team yet
                else:
                    self.thread = None
