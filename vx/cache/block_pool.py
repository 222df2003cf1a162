"""All KV-cache blocks of one attention group: free list, prefix-cache map, ref counts."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from vx.cache.block_hash import BlockHash
from vx.cache.free_block_queue import FreeKVCacheBlockQueue
from vx.cache.kv_cache_block import KVCacheBlock


class BlockPool:
    """Owns the `num_blocks` blocks, hands them out, takes them back and runs the prefix cache.

    Block 0 is the *null block*: reserved, never in the free queue, never handed out. Padding
    slots (e.g. CUDA-graph batch padding) may point at it. It is pinned with `ref_cnt = 1` so a
    stray touch/free pair cannot push it into the free queue; it is excluded from every count,
    so `num_usable_blocks == num_blocks - 1` is the total the stats report.

    A block with `ref_cnt == 0` sits in the free queue. If it also has a `block_hash` it is a
    *cached* block: a later request with the same prefix can take it back with `touch`, and
    `get_new_blocks` evicts it (LRU) only when it is reused. Invariant:
    `block.block_hash is not None` iff `cached_block_hash_to_block[block.block_hash] is block`.

    The free queue is kept in three runs, head first, and `get_new_blocks` takes from the head:
    1. freed blocks that cache nothing (a request's partial last block, a duplicate), most
       recently freed first: their memory is resident already and nothing is lost by reusing them;
    2. blocks never handed out yet, in id order;
    3. cached blocks, least recently freed first: evicting one loses a prefix hit.
    So a block never used is taken only when every used block is held or caches a prefix, and the
    blocks ever used are always ids 1..k with k <= the peak of (in use + cached). On a CPU, where
    the KV cache's pages become resident when first written, the engine's memory follows that
    peak instead of cycling through the whole cache; and a cached block is evicted only when
    neither other kind is left, which keeps prefixes cached at least as long as plain
    first-freed-first-reused order would.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        # Kept incrementally: counting by a scan would cost O(num_blocks) per stats call.
        self._num_cached_free = 0

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0 (free or cached-evictable): what `get_new_blocks` can supply."""
        return self.free_block_queue.num_free_blocks

    def get_num_in_use_blocks(self) -> int:
        """Usable blocks held by at least one request."""
        return self.num_blocks - 1 - self.free_block_queue.num_free_blocks

    def get_num_cached_blocks(self) -> int:
        """Hashed blocks with ref_cnt 0: reusable by a prefix hit, evictable on demand."""
        return self._num_cached_free

    def get_usage(self) -> float:
        """Fraction of usable blocks in use."""
        return self.get_num_in_use_blocks() / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block registered under `block_hash`, or None."""
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the free-queue head with ref_cnt 1, evicting cached ones
        only when no other free block is left.

        Raises ValueError if fewer are free; callers check `get_num_free_blocks()` first.
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks, "
                             f"{self.free_block_queue.num_free_blocks} free")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        cache_map = self.cached_block_hash_to_block
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None:
                del cache_map[block_hash]
                block.block_hash = None
                self._num_cached_free -= 1
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (a prefix hit); ref-0 blocks leave the free queue."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
                if block.block_hash is not None:
                    self._num_cached_free -= 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference from each block; a cached one reaching 0 joins the free-queue tail in
        order, one that caches nothing the head (reused first).

        Pass blocks in the order they should be evicted, i.e. a request's tail block first, so
        that shared prefix blocks stay cached the longest.
        """
        queue = self.free_block_queue
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt <= 0:
                if block.ref_cnt < 0:
                    block.ref_cnt = 0
                    raise ValueError(f"{block!r} freed more often than allocated")
                if block.block_hash is not None:
                    queue.append(block)
                    self._num_cached_free += 1
                else:
                    queue.appendleft(block)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Register `blocks[num_cached_blocks:num_full_blocks]` (now full) under their hashes.

        `block_hashes[i]` is the hash of `blocks[i]`. Blocks already hashed (prefix hits) are
        skipped. If another block already holds a hash, that mapping is kept and this block
        stays unhashed: it is a duplicate that will simply be recycled when freed.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        cache_map = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:
                continue
            block_hash = block_hashes[i]
            if block_hash not in cache_map:
                cache_map[block_hash] = block
                block.block_hash = block_hash

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use.

        Refusing keeps things simple: a held block keeps its hash, so a partial reset would
        have to leave some entries behind anyway.
        """
        queue = self.free_block_queue
        if queue.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
            # Now caching nothing: it joins the used blocks at the head, ahead of the never-used ones.
            queue.remove(block)
            queue.appendleft(block)
        self.cached_block_hash_to_block.clear()
        self._num_cached_free = 0
        return True
