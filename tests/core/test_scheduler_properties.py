"""Stateful property test: the Scheduler and its KVCacheManager under random arrivals, aborts and steps.

There is no model: each step's `ModelRunnerOutput` samples a random token for every request that reached the
end of its known tokens, as the model runner would. Tokens come from a 4-letter alphabet and prompts often
repeat earlier ones, so prefixes are shared through the prefix cache; the KV pool is small, so steps preempt.
After every rule the block bookkeeping must hold exactly; at teardown every request must have finished or
been aborted, with no block in use.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from tests.support.worker_view import WorkerView

from vx.cache import KVCacheManager
from vx.config import CacheConfig, SchedulerConfig
from vx.core.request import Request, RequestStatus
from vx.core.scheduler import Scheduler
from vx.sampling_params import SamplingParams
from vx.step import ModelRunnerOutput

MAX_MODEL_LEN = 24
EOS = 0
TEARDOWN_MAX_STEPS = 2000


class SchedulerMachine(RuleBasedStateMachine):
    """Drives a Scheduler as EngineCore does (adds and aborts between steps) and checks its invariants."""

    @initialize(block_size=st.sampled_from([2, 4]), spare_blocks=st.integers(0, 4), budget=st.integers(1, 16),
                max_num_seqs=st.integers(1, 8), chunked=st.booleans(), caching=st.booleans(),
                policy=st.sampled_from(["fcfs", "priority"]))
    def configure(self, block_size: int, spare_blocks: int, budget: int, max_num_seqs: int, chunked: bool,
                  caching: bool, policy: str) -> None:
        # The pool holds one sequence of MAX_MODEL_LEN (as EngineArgs requires), plus a few spare blocks: small
        # enough that several requests run out of blocks and preempt each other.
        num_blocks = 1 + -(-MAX_MODEL_LEN // block_size) + spare_blocks
        if not chunked:
            budget = max(budget, MAX_MODEL_LEN)  # as EngineArgs requires: a whole prompt must fit one step
        self.block_size = block_size
        self.kv = KVCacheManager(num_blocks, block_size, caching)
        self.worker_view = WorkerView()  # the workers' side of each step's plan
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                                   enable_chunked_prefill=chunked, policy=policy),
                                   CacheConfig(block_size=block_size, enable_prefix_caching=caching), self.kv,
                                   max_model_len=MAX_MODEL_LEN)
        self.next_id = 0
        self.prompts: list[list[int]] = []
        self.outcome: dict[str, str | None] = {}  # request id -> None while live, then its finish reason
        self.configured = True

    # ------------------------------------------------------------------------------------------ rules
    @precondition(lambda self: getattr(self, "configured", False) and len(self.scheduler.requests) < 12)
    @rule(data=st.data(), count=st.integers(1, 3))
    def arrive(self, data: st.DataObject, count: int) -> None:
        """New requests; a fork starts with a prefix of an earlier prompt, as chat turns do."""
        for _ in range(count):
            tokens = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=MAX_MODEL_LEN - 1), label="tokens")
            if self.prompts and data.draw(st.booleans(), label="fork"):
                base = data.draw(st.sampled_from(self.prompts), label="base")
                tokens = (base[:data.draw(st.integers(1, len(base)))] + tokens)[:MAX_MODEL_LEN - 1]
            rid = f"r{self.next_id}"
            self.next_id += 1
            params = SamplingParams(temperature=0.0, max_tokens=data.draw(st.integers(1, 12), label="max_tokens"),
                                    ignore_eos=data.draw(st.booleans(), label="ignore_eos"))
            priority = data.draw(st.integers(-2, 2), label="priority")
            self.scheduler.add_request(Request(rid, tokens, params, [EOS], priority=priority))
            self.prompts.append(tokens)
            self.outcome[rid] = None

    @precondition(lambda self: getattr(self, "configured", False) and self.scheduler.requests)
    @rule(data=st.data(), unknown=st.booleans())
    def abort(self, data: st.DataObject, unknown: bool) -> None:
        """An abort between steps, of a live request (waiting, running or preempted) and maybe of an unknown id."""
        rid = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        status = self.scheduler.requests[rid].status
        event(f"abort {status.name}")
        ids = [rid, "no-such-request"] if unknown else [rid]
        assert self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED) == [rid]
        assert rid not in self.scheduler.requests and self.kv.get_blocks(rid) == []
        self.outcome[rid] = "abort"

    @precondition(lambda self: getattr(self, "configured", False) and self.scheduler.has_unfinished_requests())
    @rule(seed=st.integers(0, 2**32 - 1), count=st.integers(1, 4))
    def step(self, seed: int, count: int) -> None:
        """A few engine steps (an abort or an arrival comes only between steps, as in EngineCore)."""
        rng = random.Random(seed)
        for _ in range(count):
            if self.scheduler.has_unfinished_requests():
                self._step(rng)
                self.bookkeeping_is_exact()

    # ------------------------------------------------------------------------------------------ a step
    def _step(self, rng: random.Random) -> None:
        s, bs = self.scheduler, self.block_size
        preemptions_before = s.num_preemptions
        so = self.worker_view.apply(s.schedule())
        cfg = s.config
        ids = [sr.req_id for sr in so.scheduled]
        assert len(ids) == len(set(ids))
        assert so.total_num_scheduled_tokens == sum(len(sr.token_ids) for sr in so.scheduled)
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert so.num_reqs <= cfg.max_num_seqs and len(s.running) <= cfg.max_num_seqs
        assert not set(ids) & so.preempted_req_ids  # a request preempted in a step does not run in it
        assert s.num_preemptions - preemptions_before >= len(so.preempted_req_ids)
        if so.preempted_req_ids:
            event("preemption")
        for sr in so.scheduled:
            req = s.requests[sr.req_id]
            assert req.status == RequestStatus.RUNNING and sr.token_ids
            end = sr.num_computed_tokens + len(sr.token_ids)
            assert end == req.num_computed_tokens <= req.num_tokens
            assert sr.token_ids == req.all_token_ids[sr.num_computed_tokens:end]
            assert sr.samples == (end == req.num_tokens)
            block_ids = self.kv.get_block_ids(sr.req_id)
            assert len(block_ids) == -(-end // bs)  # exactly the blocks for the tokens computed by this step
            if sr.is_new:
                assert sr.new_block_ids == block_ids
                if not cfg.enable_chunked_prefill:
                    assert sr.samples
            else:
                assert block_ids[len(block_ids) - len(sr.new_block_ids):] == sr.new_block_ids
            if sr.num_computed_tokens and sr.is_new:
                event("prefix hit")

        sampled = [sr.req_id for sr in so.scheduled if sr.samples]
        tokens = [rng.randrange(4) for _ in sampled]
        outs = s.update_from_output(so.output, ModelRunnerOutput(sampled, tokens))
        assert [o.request_id for o in outs.outputs] == sampled
        for out, token in zip(outs.outputs, tokens):
            assert out.new_token_ids == [token]
            if out.finished:
                assert out.request_id not in s.requests and self.kv.get_blocks(out.request_id) == []
                assert self.outcome[out.request_id] is None
                self.outcome[out.request_id] = str(out.finish_reason)
            else:
                req = s.requests[out.request_id]
                assert req.num_output_tokens < req.max_tokens and req.num_tokens < MAX_MODEL_LEN
        assert set(outs.finished_requests) == {o.request_id for o in outs.outputs if o.finished}

    # ------------------------------------------------------------------------------------- invariants
    @invariant()
    def bookkeeping_is_exact(self) -> None:
        if not getattr(self, "configured", False):
            return
        s, kv, bs = self.scheduler, self.kv, self.block_size
        pool = kv.block_pool
        waiting_ids = [r.request_id for r in s.waiting]
        running_ids = [r.request_id for r in s.running]
        assert len(set(waiting_ids + running_ids)) == len(waiting_ids) + len(running_ids)
        assert set(s.requests) == set(waiting_ids) | set(running_ids)
        assert {rid for rid, o in self.outcome.items() if o is None} == set(s.requests)
        assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in s.waiting)
        assert all(r.status == RequestStatus.RUNNING for r in s.running)
        assert len(s.running) <= s.config.max_num_seqs
        # Only running requests hold blocks; waiting and preempted ones hold none.
        assert set(kv.coordinator.req_to_blocks) == set(running_ids)

        holders: dict[int, list[tuple[Request, int]]] = {}
        for req in s.running:
            blocks = kv.get_blocks(req.request_id)
            assert len(blocks) == -(-req.num_computed_tokens // bs) and req.num_computed_tokens > 0
            assert len({b.block_id for b in blocks}) == len(blocks) and pool.null_block not in blocks
            for i, b in enumerate(blocks):
                holders.setdefault(b.block_id, []).append((req, i))
        for block in pool.blocks[1:]:
            held_by = holders.get(block.block_id, [])
            assert block.ref_cnt == len(held_by)  # the ref count is the number of requests holding the block
            if len(held_by) > 1:  # shared only through the prefix cache: same hashed prefix, same position
                event("block shared")
                assert block.block_hash is not None
                (first, i), *others = held_by
                for other, j in others:
                    assert j == i
                    assert other.all_token_ids[:(i + 1) * bs] == first.all_token_ids[:(i + 1) * bs]
                    assert other.block_hashes[i] == first.block_hashes[i] == block.block_hash
        assert pool.null_block.ref_cnt == 1

        free = pool.free_block_queue.get_all_free_blocks()
        assert len(free) == pool.free_block_queue.num_free_blocks == len({b.block_id for b in free})
        assert {b.block_id for b in free} == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
        stats = kv.stats()
        assert stats.num_blocks_in_use == len(holders)
        assert len(free) + stats.num_blocks_in_use == stats.num_blocks_total == pool.num_blocks - 1
        for h, b in pool.cached_block_hash_to_block.items():
            assert b.block_hash == h

    def teardown(self) -> None:
        if not getattr(self, "configured", False):
            return
        rng = random.Random(0)
        for _ in range(TEARDOWN_MAX_STEPS):
            if not self.scheduler.has_unfinished_requests():
                break
            self._step(rng)
            self.bookkeeping_is_exact()
        assert not self.scheduler.has_unfinished_requests(), "requests never finished"
        assert all(o in ("stop", "length", "abort") for o in self.outcome.values()), self.outcome
        assert self.scheduler.requests == {}
        assert self.kv.stats().num_blocks_in_use == 0
        assert self.kv.num_free_blocks == self.kv.block_pool.num_blocks - 1


TestSchedulerStateful = SchedulerMachine.TestCase
TestSchedulerStateful.settings = settings(max_examples=80, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
