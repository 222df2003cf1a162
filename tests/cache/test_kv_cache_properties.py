"""Stateful property tests: random admit / prefill / decode / preempt / finish / reset.

Tokens come from a 3-letter alphabet with block size 2, so prefixes collide constantly and
blocks get shared, evicted and re-hit. A shadow "KV cache" records which token each slot
of each block holds, which proves that every prefix hit returns blocks with the right content.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.support.cache_requests import Req

from vx.cache import FreeKVCacheBlockQueue, KVCacheBlock, KVCacheManager

BS = 2
NUM_BLOCKS = 9  # 8 usable: small, so allocations fail, blocks get evicted and re-hit
MAX_TOKENS = 16
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=10)


def snapshot(kv: KVCacheManager, req: Req):
    pool = kv.block_pool
    return (
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        dict(pool.cached_block_hash_to_block),
        {k: list(v) for k, v in kv.coordinator.req_to_blocks.items()},
        dict(kv.coordinator.num_cached_blocks),
        kv.stats(),
        list(req.block_hashes),
    )


class KVCacheMachine(RuleBasedStateMachine):
    """Drives a KVCacheManager the way the scheduler does and checks its invariants."""

    enable_caching = True

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, self.enable_caching)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.next_id = 0
        self.history: list[list[int]] = []  # token lists of every request, for forks
        # block id -> the token whose KV each slot holds, as if the model had run
        self.shadow: dict[int, list[int | None]] = {
            b.block_id: [None] * BS for b in self.kv.block_pool.blocks}
        # Every block id ever handed out, and the peak of blocks in use + cached: the pool reuses a used block
        # before it takes a never-used one, unless every used block is held or caches a prefix.
        self.used: set[int] = set()
        self.peak_held = 0

    # ------------------------------------------------------------------ helpers
    def _write_kv(self, req: Req, start: int, end: int) -> None:
        """Pretend the model ran: store tokens start..end-1 of `req` into its blocks."""
        blocks = self.kv.get_blocks(req.request_id)
        for pos in range(start, end):
            block = blocks[pos // BS]
            # Only a block owned by this request alone may be written.
            assert block.ref_cnt == 1
            self.shadow[block.block_id][pos % BS] = req.all_token_ids[pos]

    def _schedule(self, req: Req, num_new: int, hits: int = 0, blocks=None) -> bool:
        before = snapshot(self.kv, req)
        held = len(self.kv.get_blocks(req.request_id))
        num_cached = self.kv.stats().num_blocks_cached
        new = self.kv.allocate_slots(req, num_new, hits, blocks)
        if new is None:
            event("allocation failed")
            assert snapshot(self.kv, req) == before
            return False
        start = req.num_computed_tokens + hits
        after = self.kv.get_blocks(req.request_id)
        # Only an allocation raises in-use + cached (a free or a hit moves blocks between the two): its peak is here.
        stats = self.kv.stats()
        self.peak_held = max(self.peak_held, stats.num_blocks_in_use + stats.num_blocks_cached)
        self.used.update(b.block_id for b in after)
        assert after[len(after) - len(new):] == new or not new
        assert len(after) == -(-(start + num_new) // BS) >= held
        if self.kv.stats().num_blocks_cached < num_cached - len(blocks or ()):
            event("cached block evicted")
        self._write_kv(req, start, start + num_new)
        req.num_computed_tokens = start + num_new
        return True

    def _preempt(self, req: Req) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        self.waiting.append(req)

    # -------------------------------------------------------------------- rules
    # Every rule has a precondition: Hypothesis enables a random subset of rules per example,
    # and an always-enabled cheap rule would otherwise fill whole examples by itself.
    @precondition(lambda self: len(self.waiting) < 4)
    @rule(data=st.data(), tokens=tokens_st, fork=st.booleans())
    def add_request(self, data: st.DataObject, tokens: list[int], fork: bool) -> None:
        """A new request; a fork repeats a prefix of an earlier one, as chat turns do."""
        if fork and self.history:
            base = data.draw(st.sampled_from(self.history))
            tokens = base[:data.draw(st.integers(0, len(base)))] + tokens[:4]
        self.waiting.append(Req(f"r{self.next_id}", tokens))
        self.history.append(tokens)
        self.next_id += 1

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def admit(self, data: st.DataObject, chunk: int) -> None:
        req = data.draw(st.sampled_from(self.waiting))
        blocks, hits = self.kv.get_computed_blocks(req)
        assert hits == len(blocks) * BS and hits < req.num_tokens
        if not self.enable_caching:
            assert hits == 0
        for i, block in enumerate(blocks):
            assert block.block_hash == req.block_hashes[i]
            assert self.shadow[block.block_id] == req.all_token_ids[i * BS:(i + 1) * BS]
        if hits:
            event("prefix hit")
            if any(b.ref_cnt > 0 for b in blocks):
                event("hit shared with a running request")
        num_new = min(chunk, req.num_tokens - hits)
        if self._schedule(req, num_new, hits, blocks):
            self.waiting.remove(req)
            self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One scheduler step over every running request: a prefill chunk or one decode
        token each; a request that cannot get blocks is preempted."""
        for req in list(self.running):
            if req.num_computed_tokens == req.num_tokens:
                if req.num_tokens >= MAX_TOKENS:
                    self.running.remove(req)
                    self.kv.free(req)
                    continue
                # The token sampled from the previous step's logits.
                req.all_token_ids.append(data.draw(st.integers(0, 2), label="token"))
            chunk = data.draw(st.integers(1, 12), label="chunk")
            num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
            if not self._schedule(req, num_new):
                self._preempt(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self._preempt(data.draw(st.sampled_from(self.running)))

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data(), reset=st.integers(0, 4))
    def finish(self, data: st.DataObject, reset: int) -> None:
        """Finish or abort a request; sometimes also try to reset the prefix cache."""
        req = data.draw(st.sampled_from(self.running + self.waiting))
        (self.running if req in self.running else self.waiting).remove(req)
        self.history.append(list(req.all_token_ids))
        self.kv.free(req)
        self.kv.free(req)  # idempotent
        if reset == 0:
            in_use = self.kv.stats().num_blocks_in_use
            assert self.kv.reset_prefix_cache() == (in_use == 0)
            if in_use == 0:
                assert self.kv.block_pool.cached_block_hash_to_block == {}
                assert self.kv.stats().num_blocks_cached == 0

    # --------------------------------------------------------------- invariants
    @invariant()
    def blocks_are_consistent(self) -> None:
        kv, pool = self.kv, self.kv.block_pool
        holders = {b.block_id: 0 for b in pool.blocks}
        for req in self.running:
            blocks = kv.get_blocks(req.request_id)
            assert len(blocks) == -(-req.num_computed_tokens // BS)
            assert len({b.block_id for b in blocks}) == len(blocks)
            assert pool.null_block not in blocks
            for b in blocks:
                holders[b.block_id] += 1
            if self.enable_caching:
                full = req.num_computed_tokens // BS
                assert len(req.block_hashes) >= full
                for i, b in enumerate(blocks[:full]):
                    assert b.block_hash in (None, req.block_hashes[i])
        for req in self.waiting:
            assert kv.get_blocks(req.request_id) == []
        assert set(kv.coordinator.req_to_blocks) == {r.request_id for r in self.running}

        queue = pool.free_block_queue
        forward = queue.get_all_free_blocks()
        backward: list[KVCacheBlock] = []
        b = queue.fake_tail.prev_free
        while b is not queue.fake_head:
            assert b is not None
            backward.append(b)
            b = b.prev_free
        assert forward == backward[::-1]
        assert len(forward) == queue.num_free_blocks == kv.num_free_blocks
        free_ids = {b.block_id for b in forward}
        assert len(free_ids) == len(forward)

        for b in pool.blocks[1:]:
            assert b.ref_cnt == holders[b.block_id]
            assert (b.block_id in free_ids) == (b.ref_cnt == 0)
        assert pool.null_block.ref_cnt == 1 and 0 not in free_ids

        for h, b in pool.cached_block_hash_to_block.items():
            assert b.block_hash == h
        hashed = [b for b in pool.blocks if b.block_hash is not None]
        assert len(hashed) == len(pool.cached_block_hash_to_block)
        if not self.enable_caching:
            assert not hashed

        # Never-used blocks go out in id order, and only when no used block that caches nothing is free.
        assert self.used == set(range(1, len(self.used) + 1))
        assert len(self.used) <= self.peak_held
        s = kv.stats()
        assert s.num_blocks_total == NUM_BLOCKS - 1
        assert s.num_blocks_in_use == sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        assert s.num_blocks_cached == sum(1 for b in hashed if b.ref_cnt == 0)
        assert s.prefix_cache_hit_tokens <= s.prefix_cache_queried_tokens
        assert kv.usage == s.num_blocks_in_use / s.num_blocks_total

    def teardown(self) -> None:
        for req in self.running + self.waiting:
            self.kv.free(req)
        s = self.kv.stats()
        assert s.num_blocks_in_use == 0
        assert self.kv.num_free_blocks == NUM_BLOCKS - 1
        assert self.kv.reset_prefix_cache()


class KVCacheMachineNoCaching(KVCacheMachine):
    enable_caching = False


_settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestKVCacheManagerStateful = KVCacheMachine.TestCase
TestKVCacheManagerStateful.settings = _settings
TestKVCacheManagerNoCachingStateful = KVCacheMachineNoCaching.TestCase
TestKVCacheManagerNoCachingStateful.settings = settings(_settings, max_examples=40)


class FreeQueueMachine(RuleBasedStateMachine):
    """FreeKVCacheBlockQueue against a plain list model."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = [KVCacheBlock(i) for i in range(8)]
        self.queue = FreeKVCacheBlockQueue(self.blocks)
        self.model = list(self.blocks)
        self.out: list[KVCacheBlock] = []

    @precondition(lambda self: self.model)
    @rule()
    def popleft(self) -> None:
        b = self.queue.popleft()
        assert b is self.model.pop(0)
        self.out.append(b)

    @rule(n=st.integers(0, 4))
    def popleft_n(self, n: int) -> None:
        if n > len(self.model):
            return
        got = self.queue.popleft_n(n)
        assert got == self.model[:n]
        del self.model[:n]
        self.out.extend(got)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(self.model))
        self.queue.remove(b)
        self.model.remove(b)
        self.out.append(b)

    @precondition(lambda self: self.out)
    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(self.out))
        self.queue.append(b)
        self.out.remove(b)
        self.model.append(b)

    @precondition(lambda self: self.out)
    @rule(data=st.data())
    def appendleft(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(self.out))
        self.queue.appendleft(b)
        self.out.remove(b)
        self.model.insert(0, b)

    @invariant()
    def matches_model(self) -> None:
        assert self.queue.get_all_free_blocks() == self.model
        assert self.queue.num_free_blocks == len(self.model)
        assert all(b.prev_free is None and b.next_free is None for b in self.out)


TestFreeQueueStateful = FreeQueueMachine.TestCase
TestFreeQueueStateful.settings = settings(max_examples=60, stateful_step_count=30,
                                          deadline=None)
