"""The waiting queues: FCFS keeps arrival order with preempted requests in front; the priority queue orders by
(priority, arrival time) and supports removal, as the scheduler uses them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from vx.core.request import Request
from vx.core.request_queue import FCFSQueue, PriorityQueue, make_request_queue
from vx.sampling_params import SamplingParams


def _req(rid: str, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(rid, [1], SamplingParams(), arrival_time=arrival, priority=priority)


def test_fcfs_order_and_prepend():
    q = FCFSQueue()
    a, b, c = _req("a"), _req("b"), _req("c")
    q.add(a), q.add(b)
    q.prepend(c)
    assert [r.request_id for r in q] == ["c", "a", "b"] and q.peek() is c
    q.remove(a)
    assert [q.pop().request_id, q.pop().request_id] == ["c", "b"] and len(q) == 0 and not q


@settings(deadline=None)  # a busy CI machine can stretch one example past Hypothesis's 200 ms default
@given(st.lists(st.tuples(st.integers(-3, 3), st.floats(0, 100), st.booleans()), min_size=1, max_size=40))
def test_priority_queue_pops_in_priority_then_arrival_order(entries):
    q = PriorityQueue()
    reqs = [_req(f"r{i}", p, t) for i, (p, t, _) in enumerate(entries)]
    for r in reqs:
        q.add(r)
    removed = [r for r, (_, _, drop) in zip(reqs, entries) if drop]
    for r in removed:
        q.remove(r)
    kept = [r for r in reqs if r not in removed]
    assert len(q) == len(kept)
    # sorted() is stable, so equal (priority, arrival) keep insertion order, as the queue's counter does.
    expected = sorted(kept, key=lambda r: (r.priority, r.arrival_time))
    assert list(q) == expected
    assert [q.pop() for _ in range(len(kept))] == expected
    assert len(q) == 0
    with pytest.raises(IndexError):
        q.peek()


def test_priority_queue_refuses_removing_what_is_not_queued():
    q = PriorityQueue()
    a = _req("a")
    q.add(a)
    q.remove(a)
    with pytest.raises(ValueError):
        q.remove(a)
    with pytest.raises(ValueError):
        q.remove(_req("b"))


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="fcfs"):
        make_request_queue("lifo")
