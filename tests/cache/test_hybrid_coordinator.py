"""HybridKVCacheCoordinator: a full-attention group and sliding-window groups, each on its own pool.

Unit cases, then a state machine in the manner of test_kv_cache_properties: random admit (with prefix hits) /
prefill chunks / decode / preempt / finish over a 3-letter alphabet, with a shadow of what each slot of each
group's blocks holds. Invariants: ref counts equal the holders, the free queues and prefix maps stay consistent,
a sliding group holds no block wholly before its window, a full group holds the whole context, and every block a
hit hands out holds the tokens its group will read.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tests.support.cache_requests import Req

from vx.cache.block_hash import update_block_hashes
from vx.cache.kv_cache_coordinator import HybridKVCacheCoordinator
from vx.kv_spec import KVCacheGroupSpec

BS = 4


def _coordinator(window: int, full_blocks: int = 64, sliding_blocks: int = 64) -> HybridKVCacheCoordinator:
    return HybridKVCacheCoordinator([KVCacheGroupSpec(full_blocks), KVCacheGroupSpec(sliding_blocks, window)],
                                    BS, enable_caching=True)


def _run(coord: HybridKVCacheCoordinator, req: Req, chunk: int) -> None:
    """Schedule the request's tokens `chunk` at a time to its end, as the scheduler would."""
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert coord.allocate(req.request_id, req.num_computed_tokens + n, None, req.num_computed_tokens) is not None
        update_block_hashes(req.block_hashes, req.all_token_ids, BS)
        coord.cache_blocks(req.request_id, req.block_hashes, req.num_computed_tokens + n)
        req.num_computed_tokens += n


def test_a_long_prompt_holds_the_whole_context_in_the_full_group_and_a_window_in_the_sliding_one():
    """A prompt of 8 windows: the full group's blocks grow with it, the sliding group's stay within the window
    plus the chunk being computed."""
    window = 8
    coord = _coordinator(window)
    req = Req("a", list(range(8 * window)))
    held = []
    while req.num_computed_tokens < req.num_tokens:
        chunk = min(4, req.num_tokens - req.num_computed_tokens)
        coord.allocate("a", req.num_computed_tokens + chunk, None, req.num_computed_tokens)
        req.num_computed_tokens += chunk
        full, sliding = coord.pools
        held.append((full.get_num_in_use_blocks(), sliding.get_num_in_use_blocks()))
    assert held[-1][0] == 8 * window // BS  # every block of the context
    # The window (8 tokens: 2 blocks before the chunk at most) plus the chunk's block: never more than 3.
    assert max(s for _, s in held) <= -(-(window - 1) // BS) + 1 + 1
    coord.free("a")
    assert [pool.get_num_in_use_blocks() for pool in coord.pools] == [0, 0]


def test_a_prefix_hit_needs_only_the_window_in_the_sliding_group():
    window = 8
    coord = _coordinator(window)
    first = Req("a", list(range(40)))
    _run(coord, first, 8)
    coord.free("a")
    second = Req("b", list(range(40)) + [99, 98])
    update_block_hashes(second.block_hashes, second.all_token_ids, BS)
    hits, num_tokens = coord.find_longest_cache_hit(second.block_hashes, second.num_tokens - 1)
    assert num_tokens == 40
    full_hit, sliding_hit = hits
    assert len(full_hit) == len(sliding_hit) == 10
    null = coord.pools[1].null_block
    # The next token (position 40) reads 33..40: blocks 8 and 9 only.
    assert sliding_hit[:8] == [null] * 8 and null not in sliding_hit[8:]
    assert coord.allocate("b", second.num_tokens, hits, 0) is not None
    assert coord.pools[1].get_num_in_use_blocks() == 3  # the 2 hit blocks and the new one


def test_a_hit_stops_where_the_sliding_group_evicted_the_window():
    """The full group caches the whole prefix, but the sliding group's pool is so small that its early blocks
    were evicted: the hit is the longest prefix whose window blocks are still cached."""
    window = 4
    coord = _coordinator(window, sliding_blocks=5)  # 4 usable blocks
    _run(coord, Req("a", list(range(24))), 4)
    coord.free("a")
    req = Req("b", list(range(24)) + [7])
    update_block_hashes(req.block_hashes, req.all_token_ids, BS)
    hits, num_tokens = coord.find_longest_cache_hit(req.block_hashes, req.num_tokens - 1)
    assert num_tokens == 24  # the last blocks of the sliding group are what window 4 reads
    coord.pools[1].get_new_blocks(4)  # someone else takes the whole sliding pool: its cached blocks go
    hits, num_tokens = coord.find_longest_cache_hit(req.block_hashes, req.num_tokens - 1)
    assert num_tokens == 0 and hits == [[], []]


def test_allocation_is_all_or_nothing():
    coord = _coordinator(8, full_blocks=3)  # 2 usable blocks in the full group
    assert coord.allocate("a", 12, None, 0) is None  # 3 blocks needed in the full group
    assert [pool.get_num_in_use_blocks() for pool in coord.pools] == [0, 0]
    assert coord.get_blocks("a") == [[], []]


class HybridMachine(RuleBasedStateMachine):
    """Drives a hybrid coordinator the way the scheduler does and checks its invariants."""

    WINDOW = 5

    def __init__(self) -> None:
        super().__init__()
        self.coord = _coordinator(self.WINDOW, full_blocks=14, sliding_blocks=8)
        self.running: list[Req] = []
        self.next_id = 0
        # (group, block id) -> the token each slot holds, as if the model had written it
        self.shadow = {(g, b.block_id): [None] * BS for g, pool in enumerate(self.coord.pools) for b in pool.blocks}

    def _write(self, req: Req, start: int, end: int) -> None:
        for g, blocks in enumerate(self.coord.get_blocks(req.request_id)):
            for pos in range(start, end):
                block = blocks[pos // BS]
                if block.block_id != 0:
                    self.shadow[g, block.block_id][pos % BS] = req.all_token_ids[pos]

    def _check_hit(self, req: Req, hits, num_tokens: int) -> None:
        """Every real block of a hit holds the tokens of the positions it covers."""
        for g, blocks in enumerate(hits):
            for i, block in enumerate(blocks):
                if block.block_id != 0:
                    assert self.shadow[g, block.block_id] == req.all_token_ids[i * BS:(i + 1) * BS], (g, i)

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=14), chunk=st.integers(1, 9))
    def admit(self, tokens: list[int], chunk: int) -> None:
        req = Req(f"r{self.next_id}", tokens)
        self.next_id += 1
        update_block_hashes(req.block_hashes, req.all_token_ids, BS)
        hits, num_hit = self.coord.find_longest_cache_hit(req.block_hashes, req.num_tokens - 1)
        self._check_hit(req, hits, num_hit)
        n = min(chunk, req.num_tokens - num_hit)
        if self.coord.allocate(req.request_id, num_hit + n, hits, num_hit) is None:
            self.coord.free(req.request_id)
            return
        req.num_computed_tokens = num_hit
        self.coord.cache_blocks(req.request_id, req.block_hashes, num_hit + n)
        self._write(req, num_hit, num_hit + n)
        req.num_computed_tokens += n
        self.running.append(req)

    @rule(data=st.data(), chunk=st.integers(1, 9), new_token=st.integers(0, 2))
    def step(self, data: st.DataObject, chunk: int, new_token: int) -> None:
        if not self.running:
            return
        req = data.draw(st.sampled_from(self.running))
        if req.num_computed_tokens == req.num_tokens:  # decode: the sampled token joins, one step of 1
            req.all_token_ids.append(new_token)
            update_block_hashes(req.block_hashes, req.all_token_ids, BS)
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        if self.coord.allocate(req.request_id, req.num_computed_tokens + n, None, req.num_computed_tokens) is None:
            self.coord.free(req.request_id)  # preempted
            self.running.remove(req)
            return
        self.coord.cache_blocks(req.request_id, req.block_hashes, req.num_computed_tokens + n)
        self._write(req, req.num_computed_tokens, req.num_computed_tokens + n)
        req.num_computed_tokens += n

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        if self.running:
            req = data.draw(st.sampled_from(self.running))
            self.coord.free(req.request_id)
            self.running.remove(req)

    @invariant()
    def groups_are_consistent(self) -> None:
        for g, group in enumerate(self.coord.groups):
            pool = group.pool
            holders: dict[int, int] = {}
            for req in self.running:
                blocks = group.get_blocks(req.request_id)
                assert len(blocks) == -(-req.num_computed_tokens // BS), (g, req.request_id)
                for i, block in enumerate(blocks):
                    if block.block_id == 0:
                        # Released: only blocks wholly before the window the next token reads.
                        assert group.sliding_window is not None
                        assert (i + 1) * BS <= req.num_computed_tokens - group.sliding_window + 1
                    else:
                        holders[block.block_id] = holders.get(block.block_id, 0) + 1
            for block in pool.blocks[1:]:
                assert block.ref_cnt == holders.get(block.block_id, 0), (g, block)
                if block.block_hash is not None:
                    assert pool.cached_block_hash_to_block[block.block_hash] is block
            free = pool.free_block_queue.get_all_free_blocks()
            assert len(free) == pool.num_usable_blocks - len(holders)
            assert all(block.ref_cnt == 0 for block in free)

    def teardown(self) -> None:
        for req in self.running:
            self.coord.free(req.request_id)
        for pool in self.coord.pools:
            assert pool.get_num_in_use_blocks() == 0


TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
