"""Scheduler: token budget, chunked prefill, preemption by recompute, stop rules, aborts."""

from __future__ import annotations

import weakref

import pytest
from tests.support.worker_view import WorkerView

from vx.cache import KVCacheManager
from vx.config import CacheConfig, SchedulerConfig
from vx.core.request import Request, RequestStatus
from vx.core.scheduler import Scheduler
from vx.pooling_params import PoolingParams
from vx.sampling_params import SamplingParams
from vx.step import ModelRunnerOutput


def make_scheduler(num_blocks=64, block_size=4, budget=32, max_seqs=8, max_len=256, chunked=True,
                   caching=True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                     enable_chunked_prefill=chunked),
                     CacheConfig(block_size=block_size, enable_prefix_caching=caching), kv, max_model_len=max_len)


def req(rid: str, n_prompt: int, max_tokens=8, eos=(), base=1, **kw) -> Request:
    return Request(rid, [base + i % 50 for i in range(n_prompt)],
                   SamplingParams(max_tokens=max_tokens, **kw), list(eos))


# Each scheduler's steps as its worker sees them.
_views: weakref.WeakKeyDictionary[Scheduler, WorkerView] = weakref.WeakKeyDictionary()


def step(s: Scheduler, token_for=lambda rid: 99):
    so = _views.setdefault(s, WorkerView()).apply(s.schedule())
    sampled = [r.req_id for r in so.scheduled if r.samples]
    out = s.update_from_output(so.output, ModelRunnerOutput(sampled, [token_for(r) for r in sampled]))
    return so, out


def run_all(s: Scheduler, max_steps=1000, **kw):
    steps = []
    while s.has_unfinished_requests():
        steps.append(step(s, **kw))
        assert len(steps) < max_steps
    return steps


def test_budget_and_max_seqs_respected():
    s = make_scheduler(budget=20, max_seqs=3)
    for i in range(6):
        s.add_request(req(f"r{i}", 13, max_tokens=5))
    for so, _ in run_all(s):
        assert so.total_num_scheduled_tokens <= 20
        assert so.num_reqs <= 3
        assert so.total_num_scheduled_tokens == sum(len(r.token_ids) for r in so.scheduled)
    assert s.kv_cache_manager.stats().num_blocks_in_use == 0


def test_chunked_prefill_catches_up_then_decodes():
    s = make_scheduler(budget=8)
    s.add_request(req("a", 21, max_tokens=3))
    sizes, samples = [], []
    for so, _ in run_all(s):
        sizes.append(so.total_num_scheduled_tokens)
        samples.append(so.scheduled[0].samples)
    assert sizes == [8, 8, 5, 1, 1]
    assert samples == [False, False, True, True, True]


def test_positions_are_contiguous_per_request():
    s = make_scheduler(budget=7)
    s.add_request(req("a", 10, max_tokens=4))
    s.add_request(req("b", 3, max_tokens=4))
    seen: dict[str, int] = {}
    for so, _ in run_all(s):
        for r in so.scheduled:
            assert r.num_computed_tokens == seen.get(r.req_id, 0)
            seen[r.req_id] = r.num_computed_tokens + len(r.token_ids)


def test_chunked_prefill_disabled_waits_for_whole_prompt():
    s = make_scheduler(budget=16, chunked=False)
    s.add_request(req("a", 12, max_tokens=2))
    s.add_request(req("b", 12, max_tokens=2, base=100))
    so, _ = step(s)
    assert [r.req_id for r in so.scheduled] == ["a"]  # b does not fit the rest of the budget
    assert so.total_num_scheduled_tokens == 12


def test_preempts_latest_arrival_and_resumes():
    # 10 usable blocks of 4 tokens; three requests growing to 16 tokens each cannot all fit.
    s = make_scheduler(num_blocks=11, block_size=4, budget=64)
    for i in range(3):
        s.add_request(req(f"r{i}", 8, max_tokens=8, base=10 * i))
    preempted_ids = []
    for so, _ in run_all(s):
        preempted_ids += list(so.preempted_req_ids)
        assert s.kv_cache_manager.stats().num_blocks_in_use <= 10
    assert s.num_preemptions > 0
    assert preempted_ids and preempted_ids[0] == "r2"
    assert s.kv_cache_manager.stats().num_blocks_in_use == 0


def test_preempted_request_keeps_its_tokens():
    s = make_scheduler(num_blocks=7, block_size=4, budget=64)
    a, b = req("a", 8, max_tokens=10, base=1), req("b", 8, max_tokens=10, base=20)
    s.add_request(a)
    s.add_request(b)
    counter = iter(range(1000, 2000))
    run_all(s, token_for=lambda rid: next(counter))
    assert s.num_preemptions > 0
    assert len(a.output_token_ids) == 10 and len(b.output_token_ids) == 10
    assert a.all_token_ids == a.prompt_token_ids + a.output_token_ids


@pytest.mark.parametrize("kw, token, n_out, status", [
    ({"max_tokens": 5}, 99, 5, RequestStatus.FINISHED_LENGTH_CAPPED),
    ({"max_tokens": 5}, 7, 1, RequestStatus.FINISHED_STOPPED),  # 7 is EOS
    ({"max_tokens": 5, "ignore_eos": True}, 7, 5, RequestStatus.FINISHED_LENGTH_CAPPED),
    ({"max_tokens": 5, "min_tokens": 3}, 7, 3, RequestStatus.FINISHED_STOPPED),
    ({"max_tokens": 5, "stop_token_ids": [99]}, 99, 1, RequestStatus.FINISHED_STOPPED),
])
def test_stop_rules(kw, token, n_out, status):
    s = make_scheduler()
    r = Request("a", [1, 2, 3], SamplingParams(**kw), [7])
    s.add_request(r)
    run_all(s, token_for=lambda rid: token)
    assert r.num_output_tokens == n_out
    assert r.status == status
    if kw.get("stop_token_ids"):
        assert r.stop_reason == 99


def test_max_model_len_caps_length():
    s = make_scheduler(max_len=12)
    r = req("a", 10, max_tokens=100)
    s.add_request(r)
    run_all(s)
    assert r.num_tokens == 12 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_abort_frees_blocks_and_reports_to_runner():
    s = make_scheduler()
    s.add_request(req("a", 10, max_tokens=50))
    s.add_request(req("b", 10, max_tokens=50))
    step(s)
    assert s.kv_cache_manager.stats().num_blocks_in_use > 0
    assert s.finish_requests(["a", "b", "zzz"], RequestStatus.FINISHED_ABORTED) == ["a", "b"]
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.stats().num_blocks_in_use == 0
    so = s.schedule()
    assert so.finished_req_ids == {"a", "b"}


def test_abort_while_step_in_flight_drops_its_token():
    s = make_scheduler()
    s.add_request(req("a", 4, max_tokens=50))
    so = s.schedule()
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out = s.update_from_output(so, ModelRunnerOutput(["a"], [5]))
    assert out.outputs == []
    assert s.kv_cache_manager.stats().num_blocks_in_use == 0


def test_duplicate_live_id_refused_and_finished_id_reusable():
    s = make_scheduler()
    s.add_request(req("a", 4, max_tokens=1))
    with pytest.raises(ValueError, match="already running"):
        s.add_request(req("a", 4))
    run_all(s)
    s.add_request(req("a", 4, max_tokens=1))
    run_all(s)


def test_prefix_hits_skip_computation():
    s = make_scheduler(block_size=4, budget=64)
    s.add_request(req("a", 17, max_tokens=1))
    run_all(s)
    s.add_request(req("b", 17, max_tokens=1))
    so, _ = step(s)
    assert so.scheduled[0].num_computed_tokens == 16
    assert so.total_num_scheduled_tokens == 1


def make_priority_scheduler(**kw) -> Scheduler:
    s = make_scheduler(**kw)
    s.config.policy = "priority"
    return Scheduler(s.config, CacheConfig(block_size=s.block_size), s.kv_cache_manager, max_model_len=s.max_model_len)


def test_priority_policy_admits_lower_priority_value_first():
    s = make_priority_scheduler(max_seqs=1)
    s.add_request(Request("late-urgent", [1, 2, 3], SamplingParams(max_tokens=1), arrival_time=2.0, priority=-5))
    s.add_request(Request("early-normal", [1, 2, 3], SamplingParams(max_tokens=1), arrival_time=1.0, priority=0))
    s.add_request(Request("early-urgent", [4, 5, 6], SamplingParams(max_tokens=1), arrival_time=1.5, priority=-5))
    order = [so.scheduled[0].req_id for so, _ in run_all(s)]
    assert order == ["early-urgent", "late-urgent", "early-normal"]


def test_fcfs_policy_ignores_priority():
    s = make_scheduler(max_seqs=1)
    s.add_request(Request("first", [1, 2, 3], SamplingParams(max_tokens=1), arrival_time=1.0, priority=9))
    s.add_request(Request("second", [1, 2, 3], SamplingParams(max_tokens=1), arrival_time=2.0, priority=-9))
    assert [so.scheduled[0].req_id for so, _ in run_all(s)] == ["first", "second"]


def test_priority_policy_preempts_the_least_important_request():
    # 2 blocks of 4 tokens per request at most; 5 usable blocks: the third request's growth must evict someone.
    s = make_priority_scheduler(num_blocks=6, block_size=4, budget=64, max_seqs=3)
    s.add_request(Request("bg", [1] * 4, SamplingParams(max_tokens=4, ignore_eos=True), arrival_time=0.0, priority=5))
    s.add_request(Request("fg", [2] * 4, SamplingParams(max_tokens=4, ignore_eos=True), arrival_time=1.0, priority=0))
    s.add_request(Request("mid", [3] * 4, SamplingParams(max_tokens=4, ignore_eos=True), arrival_time=2.0, priority=1))
    preempted: list[str] = []
    finished: list[str] = []
    for so, out in run_all(s):
        preempted += sorted(so.preempted_req_ids)
        finished += out.finished_requests
    assert preempted and set(preempted) == {"bg"}  # never the more important ones, though "bg" arrived first
    assert finished.index("fg") < finished.index("bg") and finished.index("mid") < finished.index("bg")
    assert s.kv_cache_manager.stats().num_blocks_in_use == 0


def test_priority_policy_aborts_waiting_requests():
    s = make_priority_scheduler(max_seqs=1)
    for i in range(4):
        s.add_request(Request(f"r{i}", [1, 2], SamplingParams(max_tokens=2), arrival_time=float(i), priority=-i))
    assert s.finish_requests(["r1", "r2"], RequestStatus.FINISHED_ABORTED) == ["r1", "r2"]
    order = [so.scheduled[0].req_id for so, _ in run_all(s) if so.scheduled]
    assert [rid for i, rid in enumerate(order) if i == 0 or rid != order[i - 1]] == ["r3", "r0"]


# ----------------------------------------------------------------------------------------------- pooling requests
def pooling_req(rid: str, n_prompt: int, pooling_type: str = "last", base=1) -> Request:
    return Request(rid, [base + i % 50 for i in range(n_prompt)], SamplingParams(max_tokens=1), [],
                   pooling_params=PoolingParams(pooling_type=pooling_type))


def pool_step(s: Scheduler):
    """One step whose worker pools (a vector naming the request) every pooling request that reached its prompt's end
    and samples 99 for the others."""
    so = _views.setdefault(s, WorkerView()).apply(s.schedule())
    pooled = {r.req_id: [float(len(r.req_id))] for r in so.scheduled if r.samples and r.req_id.startswith("p")}
    sampled = [r.req_id for r in so.scheduled if r.samples and r.req_id not in pooled]
    return so, s.update_from_output(so.output, ModelRunnerOutput(sampled, [99] * len(sampled), pooled=pooled or None))


def test_a_pooling_request_ends_after_its_prompt_with_its_vector_and_no_token():
    s = make_scheduler(budget=8)
    s.add_request(pooling_req("pa", 21))
    s.add_request(req("g", 5, max_tokens=3))
    outputs = {}
    while s.has_unfinished_requests():
        so, out = pool_step(s)
        assert so.total_num_scheduled_tokens <= 8
        for o in out.outputs:
            outputs.setdefault(o.request_id, []).append(o)
    (only,) = outputs["pa"]  # one output: its end, with the vector and no token
    assert only.new_token_ids == [] and only.pooled == [2.0] and str(only.finish_reason) == "stop"
    assert [t for o in outputs["g"] for t in o.new_token_ids] == [99, 99, 99]
    assert s.kv_cache_manager.stats().num_blocks_in_use == 0 and not s.requests


def test_pooling_requests_share_the_step_with_generation():
    s = make_scheduler(budget=64)
    s.add_request(req("g", 5, max_tokens=4))
    s.add_request(pooling_req("pa", 9))
    so, out = pool_step(s)
    assert so.req_ids == ["g", "pa"]
    assert {o.request_id: o.pooled for o in out.outputs} == {"g": None, "pa": [2.0]}


def test_mean_pooling_reads_no_prefix_cache_but_last_token_pooling_does():
    s = make_scheduler(block_size=4)
    s.add_request(pooling_req("pa", 13))
    pool_step(s)
    s.add_request(pooling_req("pb", 13))
    so, _ = pool_step(s)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12  # three cached blocks; the last token runs
    s.add_request(pooling_req("pc", 13, pooling_type="mean"))
    so, _ = pool_step(s)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0 and so.total_num_scheduled_tokens == 13
    assert not s.has_unfinished_requests()


def test_a_preempted_mean_pooling_request_recomputes_its_whole_prompt():
    # Both requests share each step's budget (fair shares), so 7 blocks are too few for both to finish together.
    s = make_scheduler(num_blocks=7, block_size=4, budget=4)
    s.add_request(req("g", 8, max_tokens=12, ignore_eos=True))
    s.add_request(pooling_req("pm", 16, pooling_type="mean", base=20))
    admissions = []
    while s.has_unfinished_requests():
        so, _ = pool_step(s)
        admissions += [(n.req_id, n.num_computed_tokens) for n in so.scheduled_new_reqs]
    assert s.num_preemptions > 0
    assert [a for a in admissions if a[0] == "pm"] == [("pm", 0)] * len([a for a in admissions if a[0] == "pm"])
    assert len([a for a in admissions if a[0] == "pm"]) > 1
