"""Per-request block bookkeeping over the block pools.

`UnitaryKVCacheCoordinator`: one group of full-attention layers sharing one block table per request (most models):
one `BlockTableGroup`, with a plain prefix scan for hits and a fast path for steps that need no block. `HybridKVCacheCoordinator`: one group per attention kind
(`vx.cache.block_table_group`), for models that mix sliding-window and global layers or whose every layer is
windowed: each group has its own pool, and a sliding group releases the blocks that fell out of its window.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from vx.cache.block_hash import BlockHash
from vx.cache.block_pool import BlockPool
from vx.cache.block_table_group import BlockTableGroup
from vx.cache.kv_cache_block import KVCacheBlock
from vx.kv_spec import KVCacheGroupSpec


class KVCacheCoordinator(ABC):
    """Maps request ids to their blocks and turns token counts into pool operations."""

    block_size: int
    enable_caching: bool
    block_pool: BlockPool

    @abstractmethod
    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> list[KVCacheBlock]:
        """Cached blocks for the longest prefix of `block_hashes`, covering at most
        `max_cache_hit_length` tokens. The blocks are not touched."""

    @abstractmethod
    def allocate(self, request_id: str, num_tokens: int,
                 new_computed_blocks: Sequence[KVCacheBlock]) -> list[KVCacheBlock] | None:
        """Touch and append `new_computed_blocks` (a prefix hit, only at the first allocation),
        then add fresh blocks until `num_tokens` tokens fit; returns the fresh blocks, or None
        with nothing changed when the free pool cannot supply them."""

    @abstractmethod
    def cache_blocks(self, request_id: str, block_hashes: Sequence[BlockHash],
                     num_tokens: int) -> None:
        """Register the request's blocks that are full within its first `num_tokens` tokens."""

    @abstractmethod
    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first; no-op for an unknown id."""

    @abstractmethod
    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's blocks in token order ([] if unknown)."""


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """A single full-attention KV-cache group: one block list per request (one `BlockTableGroup`, whose prefix
    hits are a plain scan of the cached prefix)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.group = BlockTableGroup(KVCacheGroupSpec(num_blocks), block_size, enable_caching)
        self.block_pool = self.group.pool
        # The group's own dicts, under the names the tests and the manager read.
        self.req_to_blocks = self.group.req_to_blocks
        self.num_cached_blocks = self.group.num_cached_blocks

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> list[KVCacheBlock]:
        lookup = self.block_pool.cached_block_hash_to_block.get
        hits: list[KVCacheBlock] = []
        for i in range(min(len(block_hashes), max_cache_hit_length // self.block_size)):
            block = lookup(block_hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(self, request_id: str, num_tokens: int,
                 new_computed_blocks: Sequence[KVCacheBlock]) -> list[KVCacheBlock] | None:
        blocks = self.req_to_blocks.get(request_id)
        # Most decode steps: the request's last block has room for the new token.
        if blocks and not new_computed_blocks and num_tokens <= len(blocks) * self.block_size:
            return []
        if new_computed_blocks and blocks:
            raise ValueError(f"request {request_id!r} already holds blocks; computed blocks can only be added at "
                             "its first allocation")
        needed = self.group.num_blocks_needed(request_id, num_tokens, new_computed_blocks)
        if needed > self.block_pool.free_block_queue.num_free_blocks:
            return None
        return self.group.allocate(request_id, num_tokens, new_computed_blocks)

    def cache_blocks(self, request_id: str, block_hashes: Sequence[BlockHash],
                     num_tokens: int) -> None:
        self.group.cache_blocks(request_id, block_hashes, num_tokens)

    def free(self, request_id: str) -> None:
        self.group.free(request_id)

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.group.get_blocks(request_id)


class HybridKVCacheCoordinator:
    """Several groups of layers (full attention, sliding windows), each with its own pool and block tables.

    A request's blocks are one list per group, all covering the same tokens. A prefix hit is the longest one every
    group can serve: full groups need the whole prefix cached, a sliding group only the blocks its window reads
    for the next token. An allocation takes blocks from every group or, when one pool is short, from none.
    Before allocating, sliding groups release the blocks that fell out of their window.
    """

    def __init__(self, specs: Sequence[KVCacheGroupSpec], block_size: int, enable_caching: bool) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not specs:
            raise ValueError("a hybrid KV cache needs at least one group")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups = [BlockTableGroup(spec, block_size, enable_caching) for spec in specs]

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[list[list[KVCacheBlock]], int]:
        """(each group's hit blocks, the tokens they cover) for the longest prefix every group serves."""
        max_blocks = max_cache_hit_length // self.block_size
        servable = [group.cache_hit_lengths(block_hashes, max_blocks) for group in self.groups]
        num_blocks = next(n for n in range(len(servable[0]) - 1, -1, -1) if all(ok[n] for ok in servable))
        return [group.hit_blocks(block_hashes, num_blocks) for group in self.groups], num_blocks * self.block_size

    def allocate(self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[Sequence[KVCacheBlock]] | None,
                 num_computed_tokens: int) -> list[list[KVCacheBlock]] | None:
        """Release what fell out of the windows, then give the request blocks for `num_tokens` tokens in every
        group: the new blocks per group, or None with nothing allocated when a pool is short."""
        hits = new_computed_blocks or [()] * len(self.groups)
        for group in self.groups:
            group.release_out_of_window(request_id, num_computed_tokens)
        for group, hit in zip(self.groups, hits):
            if group.num_blocks_needed(request_id, num_tokens, hit) > group.pool.get_num_free_blocks():
                return None
        return [group.allocate(request_id, num_tokens, hit) for group, hit in zip(self.groups, hits)]

    def cache_blocks(self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Register, in every group, the request's blocks that are full within its first `num_tokens` tokens."""
        for group in self.groups:
            group.cache_blocks(request_id, block_hashes, num_tokens)

    def free(self, request_id: str) -> None:
        """Release the request's blocks in every group; no-op for an unknown id."""
        for group in self.groups:
            group.free(request_id)

    def get_blocks(self, request_id: str) -> list[list[KVCacheBlock]]:
        """The request's blocks per group, in token order."""
        return [group.get_blocks(request_id) for group in self.groups]

    @property
    def pools(self) -> list[BlockPool]:
        return [group.pool for group in self.groups]
