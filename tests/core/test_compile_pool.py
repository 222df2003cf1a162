"""CompilePool: a compile past its deadline fails its own future while the others proceed, its thread's result is
discarded, and abandoned threads never pile up past the pool's ceiling."""

from __future__ import annotations

import threading
import time

import pytest

from vx.core.compile_pool import CompilePool, CompileQueueTimeoutError, CompileTimeoutError


class Blocker:
    """compile_fn whose keys starting with "slow" wait for `release`; the others return at once."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __call__(self, key: str) -> str:
        if key.startswith("slow"):
            self.release.wait(30)
        return f"compiled {key}"


def expire_until(pool: CompilePool, futures, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(f.done() for f in futures):
        assert time.monotonic() < deadline, "the futures never finished"
        pool.expire()
        time.sleep(0.01)


def test_a_slow_compile_fails_alone_and_its_result_is_discarded():
    fn = Blocker()
    pool = CompilePool(fn, workers=2, timeout_s=1.0)
    slow = pool.submit("slow")
    fast = [pool.submit(f"fast{i}") for i in range(5)]  # the second worker serves them while "slow" blocks
    expire_until(pool, fast)
    assert [f.result() for f in fast] == [f"compiled fast{i}" for i in range(5)]
    assert not slow.done()
    expire_until(pool, [slow])
    with pytest.raises(CompileTimeoutError, match="longer than 1 s"):
        slow.result()
    assert pool.num_abandoned == 1 and pool.num_threads == 1
    fn.release.set()  # the abandoned compile ends; its result goes nowhere
    expire_until(pool, [pool.submit("fast-after")])
    assert pool.num_threads == 0 and pool.num_abandoned == 0
    with pytest.raises(CompileTimeoutError):
        slow.result()


def test_abandoned_threads_are_bounded_and_queued_compiles_fail_rather_than_wait_forever():
    fn = Blocker()
    pool = CompilePool(fn, workers=1, timeout_s=0.15, max_abandoned=1)  # at most 2 compile threads, ever
    first, second = pool.submit("slow-1"), pool.submit("slow-2")
    expire_until(pool, [first])  # "slow-1" is abandoned, and "slow-2" takes the free worker
    expire_until(pool, [second])  # now both are abandoned: the pool is at its ceiling of two threads
    third = pool.submit("fast")
    assert pool.num_threads == 2
    expire_until(pool, [third])
    with pytest.raises(CompileQueueTimeoutError, match="no compile could start within 0.15 s"):
        third.result()
    assert pool.num_threads == 2  # no third thread was started
    fn.release.set()
    expire_until(pool, [pool.submit("fast-again")])
    assert pool.num_threads == 0


def test_errors_reach_the_future_and_shutdown_cancels_the_queue():
    def fn(key):
        if key == "bad":
            raise ValueError("does not compile")
        time.sleep(0.2)
        return key

    pool = CompilePool(fn, workers=1, timeout_s=10)
    bad = pool.submit("bad")
    with pytest.raises(ValueError, match="does not compile"):
        bad.result(timeout=5)
    running, queued = pool.submit("a"), pool.submit("b")
    pool.shutdown()
    assert queued.cancelled() and running.result(timeout=5) == "a"
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit("c")
