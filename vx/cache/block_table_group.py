"""The block tables of one group of layers with the same attention kind, over the group's own block pool.

A model whose layers all attend in full has one group (`UnitaryKVCacheCoordinator`). A model with sliding-window
layers (Gemma: sliding-window and global layers) has one group per kind
(`HybridKVCacheCoordinator`), each with its pool, its per-request block list and its prefix cache:

- full attention: a request holds a block for every position it has computed;
- a sliding window of w: the next token at position p reads positions p - w + 1 .. p only, so the blocks wholly
  before the window are released while the request runs (to the pool, cached if they were full: a later
  request's prefix hit may take them back); their places in the request's list hold the pool's null block, so
  block indices stay token positions / block_size. The worker keeps the old ids in its table: attention never
  reads positions outside the window, so it never reads those entries.
"""

from __future__ import annotations

from collections.abc import Sequence

from vx.cache.block_hash import BlockHash
from vx.cache.block_pool import BlockPool
from vx.cache.kv_cache_block import KVCacheBlock
from vx.kv_spec import KVCacheGroupSpec


class BlockTableGroup:
    """Per-request block lists of one group, and the pool operations behind them."""

    def __init__(self, spec: KVCacheGroupSpec, block_size: int, enable_caching: bool) -> None:
        if spec.sliding_window is not None and spec.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {spec.sliding_window}")
        self.sliding_window = spec.sliding_window
        self.block_size = block_size
        self.pool = BlockPool(spec.num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks already registered in the prefix cache
        self.num_released: dict[str, int] = {}  # leading blocks already released (null) as out of the window

    # ------------------------------------------------------------------ prefix hits
    def cache_hit_lengths(self, block_hashes: Sequence[BlockHash], max_blocks: int) -> list[bool]:
        """hit_ok[n] for n in 0..max_blocks: whether a prefix hit of n blocks is servable by this group (all
        the blocks it would read for the next token are cached)."""
        lookup = self.pool.cached_block_hash_to_block.get
        limit = min(len(block_hashes), max_blocks)
        cached = [lookup(block_hashes[i]) is not None for i in range(limit)]
        ok = [True] + [False] * limit
        run = 0  # cached blocks in a row ending at block n - 1
        for n in range(1, limit + 1):
            run = run + 1 if cached[n - 1] else 0
            ok[n] = run >= n - self._first_needed_block(n * self.block_size)
        return ok

    def hit_blocks(self, block_hashes: Sequence[BlockHash], num_blocks: int) -> list[KVCacheBlock]:
        """The blocks of a servable hit of `num_blocks` blocks: the cached ones the next token reads, the null
        block before them."""
        first = self._first_needed_block(num_blocks * self.block_size)
        lookup = self.pool.cached_block_hash_to_block
        return [self.pool.null_block] * first + [lookup[block_hashes[i]] for i in range(first, num_blocks)]

    def _first_needed_block(self, num_computed_tokens: int) -> int:
        """The first block the token at position `num_computed_tokens` may read."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    # ------------------------------------------------------------------ allocation
    def release_out_of_window(self, request_id: str, num_computed_tokens: int) -> None:
        """Release the blocks no later token of the request will read (sliding window groups only)."""
        blocks = self.req_to_blocks.get(request_id)
        if self.sliding_window is None or not blocks:
            return
        first = min(self._first_needed_block(num_computed_tokens), len(blocks))
        start = self.num_released.get(request_id, 0)
        if first <= start:
            return
        null = self.pool.null_block
        released = [b for b in blocks[start:first] if b is not null]
        blocks[start:first] = [null] * (first - start)
        self.num_released[request_id] = first
        self.pool.free_blocks(released)  # oldest first: evicted first

    def num_blocks_needed(self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]) -> int:
        """Free blocks an `allocate` of these arguments takes from the pool (fresh ones and ref-0 hits)."""
        held = len(self.req_to_blocks.get(request_id, ()))
        needed = max(0, -(-num_tokens // self.block_size) - held - len(new_computed_blocks))
        null = self.pool.null_block
        return needed + sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and b is not null)

    def allocate(self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock],
                 ) -> list[KVCacheBlock]:
        """Take the hit and fresh blocks until `num_tokens` fit (the caller checked `num_blocks_needed`)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
            self.num_cached_blocks[request_id] = 0
            self.num_released[request_id] = 0
        if new_computed_blocks:
            if blocks:
                raise ValueError(f"request {request_id!r} already holds blocks; computed blocks can only be "
                                 "added at its first allocation")
            null = self.pool.null_block
            self.pool.touch(b for b in new_computed_blocks if b is not null)
            blocks.extend(new_computed_blocks)
            self.num_cached_blocks[request_id] = len(blocks)  # hits are registered already
            self.num_released[request_id] = sum(1 for b in new_computed_blocks if b is null)
        num_new = -(-num_tokens // self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Register the request's blocks that are full within its first `num_tokens` tokens."""
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached_blocks[request_id]
        if num_full <= num_cached:
            return
        # Blocks already released are past registering (they were full, hence registered, before release).
        start = max(num_cached, self.num_released[request_id])
        self.pool.cache_full_blocks(self.req_to_blocks[request_id], block_hashes, start, num_full)
        self.num_cached_blocks[request_id] = num_full

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first (its prefix stays cached the longest)."""
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks is None:
            return
        del self.num_cached_blocks[request_id]
        del self.num_released[request_id]
        null = self.pool.null_block
        self.pool.free_blocks(b for b in reversed(blocks) if b is not null)

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's blocks in token order (null where released); [] if unknown."""
        return self.req_to_blocks.get(request_id) or []
