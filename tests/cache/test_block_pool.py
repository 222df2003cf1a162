"""BlockPool and FreeKVCacheBlockQueue: allocation, LRU eviction, touch/free, caching."""

import pytest

from tests.support.cache_requests import Req

from vx.cache import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, hash_block_tokens


def ids(blocks):
    return [b.block_id for b in blocks]


def h(i: int) -> bytes:
    return hash_block_tokens(None, [i])


# ------------------------------------------------------------------ free queue
def test_free_queue_basic_ops():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == len(q) == 5
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    assert q.popleft() is blocks[0]
    q.remove(blocks[2])
    assert ids(q.get_all_free_blocks()) == [1, 3, 4]
    q.append(blocks[0])
    q.append(blocks[2])
    assert ids(q.get_all_free_blocks()) == [1, 3, 4, 0, 2]
    assert ids(q.popleft_n(3)) == [1, 3, 4]
    assert ids(q.get_all_free_blocks()) == [0, 2]
    assert q.num_free_blocks == 2
    assert q.popleft_n(0) == []
    with pytest.raises(IndexError):
        q.popleft_n(3)
    assert ids(q.popleft_n(2)) == [0, 2]
    with pytest.raises(IndexError):
        q.popleft()
    assert q.get_all_free_blocks() == [] and q.num_free_blocks == 0
    q.append(blocks[4])
    assert ids(q.get_all_free_blocks()) == [4]


def test_free_queue_appendleft_links_at_the_head():
    blocks = [KVCacheBlock(i) for i in range(4)]
    q = FreeKVCacheBlockQueue(blocks[:2])
    q.appendleft(blocks[2])
    q.append(blocks[3])
    assert ids(q.get_all_free_blocks()) == [2, 0, 1, 3] and q.num_free_blocks == 4
    with pytest.raises(ValueError):
        q.appendleft(blocks[0])
    assert ids(q.popleft_n(4)) == [2, 0, 1, 3]
    q.appendleft(blocks[1])  # into an empty queue
    assert ids(q.get_all_free_blocks()) == [1] and q.fake_tail.prev_free is blocks[1]


def test_free_queue_rejects_double_insert_and_bad_remove():
    blocks = [KVCacheBlock(i) for i in range(3)]
    q = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError):
        q.append(blocks[1])
    b = q.popleft()
    with pytest.raises(ValueError):
        q.remove(b)
    assert q.num_free_blocks == 2


def test_free_queue_links_both_ways():
    blocks = [KVCacheBlock(i) for i in range(4)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[1])
    backwards = []
    b = q.fake_tail.prev_free
    while b is not q.fake_head:
        backwards.append(b.block_id)
        b = b.prev_free
    assert backwards == [3, 2, 0]


# ------------------------------------------------------------------ block pool
def test_null_block_is_reserved():
    pool = BlockPool(5, enable_caching=True)
    assert pool.num_usable_blocks == 4
    assert pool.get_num_free_blocks() == 4
    got = pool.get_new_blocks(4)
    assert 0 not in ids(got)
    assert pool.get_num_in_use_blocks() == 4 and pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(got)
    assert pool.get_num_in_use_blocks() == 0
    assert pool.null_block.block_id == 0 and pool.null_block.prev_free is None
    with pytest.raises(ValueError):
        BlockPool(1, enable_caching=True)


def test_null_block_touch_free_is_harmless():
    pool = BlockPool(3, enable_caching=True)
    pool.touch([pool.null_block])
    pool.free_blocks([pool.null_block])
    assert pool.get_num_free_blocks() == 2 and pool.null_block.ref_cnt == 1


def test_get_new_blocks_sets_ref_and_pops_from_head():
    pool = BlockPool(6, enable_caching=False)
    a = pool.get_new_blocks(2)
    assert ids(a) == [1, 2] and all(b.ref_cnt == 1 for b in a)
    assert pool.get_num_free_blocks() == 3


def test_lru_eviction_order_follows_free_order():
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, [h(i) for i in range(4)], 0, 4)
    # A request frees its tail first, so its last blocks are evicted first.
    pool.free_blocks(reversed(blocks))
    assert pool.get_num_cached_blocks() == 4
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [4, 3, 2, 1]
    first = pool.get_new_blocks(1)
    assert ids(first) == [4]
    assert first[0].block_hash is None
    assert pool.get_cached_block(h(3)) is None
    assert pool.get_cached_block(h(0)) is blocks[0]
    assert pool.get_num_cached_blocks() == 3


def test_touch_pulls_cached_block_out_of_free_queue():
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [h(0), h(1), h(2)], 0, 2)
    pool.free_blocks(blocks)
    assert pool.get_num_cached_blocks() == 2
    hit = pool.get_cached_block(h(1))
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert hit not in pool.free_block_queue.get_all_free_blocks()
    assert pool.get_num_free_blocks() == 3 and pool.get_num_cached_blocks() == 1
    pool.touch([hit])
    assert hit.ref_cnt == 2 and pool.get_num_free_blocks() == 3
    pool.free_blocks([hit])
    assert hit.ref_cnt == 1 and pool.get_num_cached_blocks() == 1
    pool.free_blocks([hit])
    assert pool.get_num_cached_blocks() == 2
    assert pool.free_block_queue.get_all_free_blocks()[-1] is hit


def test_cache_full_blocks_keeps_existing_mapping():
    pool = BlockPool(5, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [h(7)], 0, 1)
    pool.cache_full_blocks([b], [h(7)], 0, 1)
    assert pool.get_cached_block(h(7)) is a
    assert a.block_hash == h(7) and b.block_hash is None
    pool.free_blocks([b, a])
    assert pool.get_num_cached_blocks() == 1


def test_cache_full_blocks_noop_without_caching():
    pool = BlockPool(3, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [h(0)], 0, 1)
    assert pool.cached_block_hash_to_block == {} and blocks[0].block_hash is None


def test_double_free_raises():
    pool = BlockPool(3, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(ValueError):
        pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.get_num_free_blocks() == 2


def test_reset_prefix_cache():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(0), h(1)], 0, 2)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h(0)) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.get_num_cached_blocks() == 0 and pool.get_num_free_blocks() == 3


def test_freed_blocks_that_cache_nothing_are_reused_before_unused_and_cached_ones():
    pool = BlockPool(8, enable_caching=True)
    a = pool.get_new_blocks(3)  # 1, 2, 3
    pool.cache_full_blocks(a, [h(0), h(1)], 0, 2)  # 1 and 2 cache a prefix, 3 (partial) nothing
    pool.free_blocks(reversed(a))
    # Head first: the used block that caches nothing, the never-used blocks, the cached blocks (LRU).
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 4, 5, 6, 7, 2, 1]
    assert ids(pool.get_new_blocks(1)) == [3]
    assert ids(pool.get_new_blocks(4)) == [4, 5, 6, 7]
    assert pool.get_num_cached_blocks() == 2  # kept while a never-used block was left
    evicted = pool.get_new_blocks(1)
    assert ids(evicted) == [2] and pool.get_cached_block(h(1)) is None and pool.get_cached_block(h(0)) is a[0]


def test_a_cached_block_outlives_a_block_freed_after_it_that_caches_nothing():
    # First freed first reused would evict block 1 here, and lose its prefix.
    pool = BlockPool(5, enable_caching=True)
    a = pool.get_new_blocks(4)
    pool.cache_full_blocks(a, [h(0)], 0, 1)
    pool.free_blocks([a[0]])
    pool.free_blocks([a[1]])
    assert ids(pool.get_new_blocks(1)) == [2]
    assert pool.get_cached_block(h(0)) is a[0]


def test_reset_prefix_cache_puts_the_blocks_it_uncaches_ahead_of_unused_ones():
    pool = BlockPool(6, enable_caching=True)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, [h(0), h(1)], 0, 2)
    pool.free_blocks(reversed(a))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 4, 5, 2, 1]
    assert pool.reset_prefix_cache()
    assert ids(pool.free_block_queue.get_all_free_blocks())[:2] in ([1, 2], [2, 1])
    assert ids(pool.get_new_blocks(2)) in ([1, 2], [2, 1])


@pytest.mark.parametrize("enable_caching", [True, False])
def test_many_short_requests_touch_no_more_blocks_than_their_peak(enable_caching):
    """A long run of short requests, at most 3 at once: the blocks ever handed out stay within the peak of blocks
    in use plus cached ones, and are the lowest ids, so on a CPU the cache's resident pages stay at that peak."""
    from vx.cache import KVCacheManager

    bs = 4
    kv = KVCacheManager(num_blocks=1000, block_size=bs, enable_caching=enable_caching)
    pool = kv.block_pool
    used: set[int] = set()
    peak = 0
    running: list = []
    for i in range(300):
        tokens = [i, i + 1, i + 2, 7, 7, 7, 7, 7, 9, 9][: 3 + i % 8]  # distinct prompts of 3-10 tokens
        req = Req(str(i), tokens)
        blocks, hits = kv.get_computed_blocks(req)
        assert kv.allocate_slots(req, req.num_tokens - hits, hits, blocks) is not None
        req.num_computed_tokens = req.num_tokens
        used.update(kv.get_block_ids(req.request_id))
        stats = kv.stats()
        peak = max(peak, stats.num_blocks_in_use + stats.num_blocks_cached)
        running.append(req)
        if len(running) == 3:
            kv.free(running.pop(0))
    assert used == set(range(1, len(used) + 1))
    assert len(used) <= peak
    if not enable_caching:
        assert len(used) <= 3 * 3  # three requests of at most three blocks
    else:
        assert pool.get_num_cached_blocks() > 0
