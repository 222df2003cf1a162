"""KVCacheManager: prefix hits, sharing, the last-token rule, capacity checks, stats."""

from __future__ import annotations

import pytest

from tests.support.cache_requests import Req

from vx.cache import KVCacheManager, KVCacheStats

BS = 4


def admit(kv: KVCacheManager, req: Req, num_new: int | None = None):
    """What the scheduler does for a waiting request; returns (new blocks, hits)."""
    blocks, hits = kv.get_computed_blocks(req)
    n = req.num_tokens - hits if num_new is None else num_new
    new = kv.allocate_slots(req, n, hits, blocks)
    if new is not None:
        req.num_computed_tokens = hits + n
    return new, hits


def decode(kv: KVCacheManager, req: Req, token: int):
    """One decode step: the sampled token is appended, its KV computed next step."""
    req.all_token_ids.append(token)
    new = kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens)
    if new is not None:
        req.num_computed_tokens = req.num_tokens
    return new


def snapshot(kv: KVCacheManager):
    pool = kv.block_pool
    return (
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        dict(pool.cached_block_hash_to_block),
        {k: list(v) for k, v in kv.coordinator.req_to_blocks.items()},
        kv.stats(),
    )


def test_prefix_hit_shares_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = Req("a", list(range(10)))
    new_a, hits = admit(kv, a)
    assert hits == 0 and len(new_a) == 3
    b = Req("b", list(range(8)) + [99, 98, 97])
    new_b, hits = admit(kv, b)
    assert hits == 8
    blocks_a, blocks_b = kv.get_blocks("a"), kv.get_blocks("b")
    assert blocks_b[:2] == blocks_a[:2]
    assert all(blk.ref_cnt == 2 for blk in blocks_a[:2])
    assert new_b == blocks_b[2:] and blocks_b[2] is not blocks_a[2]
    assert kv.stats().num_blocks_in_use == 4
    assert kv.get_block_ids("b") == [blk.block_id for blk in blocks_b]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_last_token_is_always_recomputed(k):
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(k * BS))
    admit(kv, Req("a", prompt))
    _, hits = admit(kv, Req("b", prompt))
    assert hits == (k - 1) * BS
    _, hits = admit(kv, Req("c", prompt + [42]))
    assert hits == k * BS


def test_stats_count_queries_of_unscheduled_requests_only():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    admit(kv, Req("a", list(range(8))))
    b = Req("b", list(range(9)))
    admit(kv, b)
    kv.get_computed_blocks(b)  # num_computed_tokens > 0: not counted
    s = kv.stats()
    assert s == KVCacheStats(num_blocks_total=15, num_blocks_in_use=3, num_blocks_cached=0,
                             prefix_cache_queried_tokens=17, prefix_cache_hit_tokens=8)


def test_caching_disabled():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    a = Req("a", list(range(8)))
    new, hits = admit(kv, a)
    assert hits == 0 and len(new) == 2
    assert a.block_hashes == []
    _, hits = admit(kv, Req("b", list(range(8))))
    assert hits == 0
    kv.free(a)
    s = kv.stats()
    assert s.num_blocks_cached == 0 and s.prefix_cache_queried_tokens == 0
    assert kv.block_pool.cached_block_hash_to_block == {}
    assert s.num_blocks_in_use == 2


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable
    a = Req("a", list(range(12)))
    assert admit(kv, a)[0] is not None
    b = Req("b", [50] * 9)
    blocks, hits = kv.get_computed_blocks(b)
    before = snapshot(kv)
    assert kv.allocate_slots(b, b.num_tokens - hits, hits, blocks) is None
    assert snapshot(kv) == before
    assert kv.get_blocks("b") == []


def test_capacity_counts_evictable_computed_blocks():
    # The hit block sits in the free queue; touching it takes it out of the free pool, so
    # it cannot also be counted as room for a new block.
    kv = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable
    a = Req("a", list(range(5)))
    admit(kv, a)
    kv.free(a)  # block with tokens 0..3 cached, ref 0
    assert kv.stats().num_blocks_cached == 1 and kv.num_free_blocks == 3
    b = Req("b", list(range(12)) + [1])  # hit 1 block, needs 3 more
    blocks, hits = kv.get_computed_blocks(b)
    assert hits == BS
    before = snapshot(kv)
    assert kv.allocate_slots(b, b.num_tokens - hits, hits, blocks) is None
    assert snapshot(kv) == before
    c = Req("c", list(range(12)))  # hit 1 block, needs 2 more: fits exactly
    new, hits = admit(kv, c)
    assert hits == BS and len(new) == 2 and kv.num_free_blocks == 0


def test_decode_fills_block_and_caches_it():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = Req("a", [1, 2, 3])
    admit(kv, a)
    assert a.block_hashes == [] and kv.block_pool.cached_block_hash_to_block == {}
    assert decode(kv, a, 4) == []
    assert len(a.block_hashes) == 1
    assert kv.block_pool.get_cached_block(a.block_hashes[0]) is kv.get_blocks("a")[0]
    new = decode(kv, a, 5)
    assert len(new) == 1 and len(kv.get_blocks("a")) == 2
    _, hits = admit(kv, Req("b", [1, 2, 3, 4, 9]))
    assert hits == BS


def test_chunked_prefill_caches_only_computed_full_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = Req("a", list(range(14)))
    new, hits = admit(kv, a, num_new=6)
    assert len(new) == 2 and a.num_computed_tokens == 6
    # All 3 full blocks are hashed up front, but only the computed one is registered.
    assert len(a.block_hashes) == 3
    assert len(kv.block_pool.cached_block_hash_to_block) == 1
    new = kv.allocate_slots(a, 8)
    a.num_computed_tokens = 14
    assert len(new) == 2 and len(kv.block_pool.cached_block_hash_to_block) == 3


def test_preempted_request_finds_its_own_blocks():
    kv = KVCacheManager(num_blocks=5, block_size=BS)  # exactly the 4 blocks a needs
    a = Req("a", list(range(9)))
    admit(kv, a)
    for t in (100, 101, 102, 103):
        decode(kv, a, t)
    old = kv.get_block_ids("a")
    assert len(old) == 4
    kv.free(a)  # preemption
    a.num_computed_tokens = 0
    assert kv.stats().num_blocks_in_use == 0
    new, hits = admit(kv, a)
    assert hits == 12 and len(new) == 1
    # The tail block was freed first, so it is also the first handed out again.
    assert kv.get_block_ids("a") == old


def test_prefix_blocks_outlive_tail_blocks():
    kv = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable
    a = Req("a", list(range(13)))  # 3 full blocks + 1 partial
    admit(kv, a)
    kv.free(a)
    # Needs 2 fresh blocks: the partial tail block and the last full block go first.
    b = Req("b", [77] * 5)
    admit(kv, b)
    _, hits = kv.get_computed_blocks(Req("c", list(range(13))))
    assert hits == 2 * BS


def test_free_is_idempotent_and_unknown_ids_are_empty():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = Req("a", list(range(6)))
    admit(kv, a)
    kv.free(a)
    kv.free(a)
    kv.free(Req("nobody", [1]))
    assert kv.get_blocks("a") == [] and kv.get_block_ids("nobody") == []
    assert kv.stats().num_blocks_in_use == 0 and kv.num_free_blocks == 7


def test_usage_and_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=9, block_size=BS)
    a = Req("a", list(range(8)))
    admit(kv, a)
    assert kv.usage == pytest.approx(2 / 8)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.usage == 0.0 and kv.stats().num_blocks_cached == 2
    assert kv.reset_prefix_cache() is True
    assert kv.stats().num_blocks_cached == 0
    a.num_computed_tokens = 0
    _, hits = admit(kv, a)
    assert hits == 0


def test_bad_arguments_raise():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = Req("a", list(range(9)))
    admit(kv, a)
    b = Req("b", list(range(9)))
    blocks, hits = kv.get_computed_blocks(b)
    with pytest.raises(ValueError):
        kv.allocate_slots(b, 1, hits + 1, blocks)
    with pytest.raises(ValueError):
        kv.allocate_slots(a, 1, hits, blocks)  # a already holds blocks
    with pytest.raises(ValueError):
        kv.allocate_slots(a, -1)


def test_slots_beyond_known_tokens_are_not_hashed():
    # E.g. lookahead slots for speculative tokens: allocated, but their content is unknown.
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = Req("a", list(range(6)))
    new = kv.allocate_slots(a, 6 + 5)
    assert new is not None and len(new) == 3
    assert len(a.block_hashes) == 1 and len(kv.block_pool.cached_block_hash_to_block) == 1
    a.num_computed_tokens = 6
    a.all_token_ids += [6, 7, 8]
    assert kv.allocate_slots(a, 3) == []
    assert len(kv.block_pool.cached_block_hash_to_block) == 2
