"""The scheduler's view of the paged KV cache: prefix hits, slot allocation, freeing, stats."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from vx.cache.block_hash import BlockHash, update_block_hashes
from vx.cache.kv_cache_block import KVCacheBlock
from vx.cache.kv_cache_coordinator import HybridKVCacheCoordinator, KVCacheCoordinator, UnitaryKVCacheCoordinator
from vx.kv_spec import KVCacheGroupSpec


class CacheRequest(Protocol):
    """What the manager reads from a request (vx.core.Request satisfies it).

    `block_hashes` belongs to the request but is filled by the manager; it stays valid across
    preemption and prefix-cache resets because hashes depend on token content only.
    """

    @property
    def request_id(self) -> str: ...
    @property
    def all_token_ids(self) -> list[int]: ...  # prompt + output so far
    @property
    def num_tokens(self) -> int: ...  # len(all_token_ids)
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def block_hashes(self) -> list[BlockHash]: ...


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """A snapshot of KV-cache occupancy and prefix-cache counters (the null block excluded)."""

    num_blocks_total: int  # usable blocks: num_blocks - 1
    num_blocks_in_use: int  # ref_cnt > 0
    num_blocks_cached: int  # hashed and ref_cnt == 0: reusable by a hit, evictable
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int


class KVCacheManager:
    """Gives each request the blocks for its tokens, sharing cached prefix blocks.

    Scheduler flow for a waiting (new or preempted) request: `get_computed_blocks`, then
    `allocate_slots(req, n, num_computed, computed_blocks)`, then set
    `req.num_computed_tokens = num_computed` (and add `n` once the step is planned). For a
    running request: `allocate_slots(req, n)`. Preemption and finishing: `free(req)`.

    Blocks are hashed and registered at allocation time, before the step that writes their KV
    runs, so a request admitted later in the same step may hit them. That is correct as long
    as the attention backend stores a layer's new K/V for the whole batch before attending
    (store-then-attend), and a scheduled request is not freed before its step has run.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 groups: Sequence[KVCacheGroupSpec] = ()) -> None:
        """`groups`: one per attention kind when the model has sliding-window layers (then each group has its own
        pool, and the block lists are per group); empty: one full-attention group of `num_blocks` blocks."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hybrid: HybridKVCacheCoordinator | None = None
        if groups:
            self.hybrid = HybridKVCacheCoordinator(groups, block_size, enable_caching)
            self.pools = self.hybrid.pools
        else:
            self.coordinator: KVCacheCoordinator = UnitaryKVCacheCoordinator(num_blocks, block_size, enable_caching)
            self.pools = [self.coordinator.block_pool]
        self.block_pool = self.pools[0]
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0

    # ------------------------------------------------------------------ admission
    def get_computed_blocks(self, request: CacheRequest) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks, and the number of tokens it covers.

        The blocks are not touched: pass them to `allocate_slots`. The last token is always
        recomputed (its logits are needed), so a fully cached request hits one block less.
        Stats: a call for a request with `num_computed_tokens == 0` (first scheduling or
        resumption after preemption) adds `num_tokens` to the queried and the hits to the hit
        counter; a request retried after a failed `allocate_slots` is counted again.
        With caching disabled: ([], 0) and no stats.
        """
        if not self.enable_caching:
            return [], 0
        update_block_hashes(request.block_hashes, request.all_token_ids, self.block_size)
        num_tokens = request.num_tokens
        if self.hybrid is not None:
            blocks, num_hit_tokens = self.hybrid.find_longest_cache_hit(request.block_hashes, num_tokens - 1)
        else:
            blocks = self.coordinator.find_longest_cache_hit(request.block_hashes, num_tokens - 1)
            num_hit_tokens = len(blocks) * self.block_size
        if request.num_computed_tokens == 0:
            self.prefix_cache_queried_tokens += num_tokens
            self.prefix_cache_hit_tokens += num_hit_tokens
        return blocks, num_hit_tokens

    # ----------------------------------------------------------------- allocation
    def allocate_slots(self, request: CacheRequest, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: Sequence[KVCacheBlock] | None = None,
                       ) -> list[KVCacheBlock] | None:
        """Make the request hold blocks for `num_computed_tokens + num_new_computed_tokens +
        num_new_tokens` tokens; return the newly allocated blocks (in order), or None, with
        nothing changed, if the free pool is too small.

        `new_computed_blocks` / `num_new_computed_tokens` are the prefix hit from
        `get_computed_blocks`, only allowed while the request holds no blocks. Blocks that
        become full once these tokens are computed are registered in the prefix cache.
        """
        if self.hybrid is not None:
            return self._allocate_hybrid(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks)
        computed = new_computed_blocks if new_computed_blocks is not None else ()
        if num_new_tokens < 0 or num_new_computed_tokens != len(computed) * self.block_size:
            raise ValueError(f"bad allocate_slots arguments: num_new_tokens={num_new_tokens}, "
                             f"num_new_computed_tokens={num_new_computed_tokens}, "
                             f"{len(computed)} computed blocks of {self.block_size} tokens")
        request_id = request.request_id
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        coordinator = self.coordinator
        new_blocks = coordinator.allocate(request_id, num_tokens, computed)
        if new_blocks is not None and self.enable_caching:
            self._cache_full_blocks(coordinator, request, num_tokens)
        return new_blocks

    def _cache_full_blocks(self, coordinator: KVCacheCoordinator | HybridKVCacheCoordinator, request: CacheRequest,
                           num_tokens: int) -> None:
        """Register the request's blocks that are full once its first `num_tokens` tokens are computed."""
        token_ids = request.all_token_ids
        block_hashes = request.block_hashes
        num_known = len(token_ids)
        if num_known // self.block_size > len(block_hashes):  # skip the call in most steps
            update_block_hashes(block_hashes, token_ids, self.block_size)
        # Only tokens that exist can be hashed; a scheduled lookahead slot is not full yet.
        coordinator.cache_blocks(request.request_id, block_hashes,
                                 num_tokens if num_tokens < num_known else num_known)

    def _allocate_hybrid(self, request: CacheRequest, num_new_tokens: int, num_new_computed_tokens: int,
                         new_computed_blocks: Any) -> list[list[KVCacheBlock]] | None:
        """`allocate_slots` over several groups: the new blocks per group."""
        hits = new_computed_blocks or None
        num_hit = len(hits[0]) * self.block_size if hits else 0
        if num_new_tokens < 0 or num_new_computed_tokens != num_hit:
            raise ValueError(f"bad allocate_slots arguments: num_new_tokens={num_new_tokens}, "
                             f"num_new_computed_tokens={num_new_computed_tokens}, a hit of {num_hit} tokens")
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens = num_computed + num_new_tokens
        new_blocks = self.hybrid.allocate(request.request_id, num_tokens, hits, num_computed)
        if new_blocks is not None and self.enable_caching:
            self._cache_full_blocks(self.hybrid, request, num_tokens)
        return new_blocks

    def new_block_ids(self, new_blocks: Any) -> list[list[int]]:
        """An `allocate_slots` result as block ids per group (what the workers append to their tables)."""
        if self.hybrid is None:
            return [[block.block_id for block in new_blocks]]
        return [[block.block_id for block in blocks] for blocks in new_blocks]

    def block_table(self, request_id: str) -> list[list[int]]:
        """The request's block ids per group, in token order (a released block of a window: the null block)."""
        if self.hybrid is None:
            return [[block.block_id for block in self.coordinator.get_blocks(request_id)]]
        return [[block.block_id for block in blocks] for blocks in self.hybrid.get_blocks(request_id)]

    def free(self, request: CacheRequest) -> None:
        """Release the request's blocks, tail first so its prefix stays cached longest.

        Idempotent; the request's `block_hashes` are kept for a later re-admission.
        """
        if self.hybrid is not None:
            self.hybrid.free(request.request_id)
            return
        self.coordinator.free(request.request_id)

    # ------------------------------------------------------------------- queries
    def get_blocks(self, request_id: str, group: int = 0) -> list[KVCacheBlock]:
        """The request's blocks of `group` in token order; the live list, do not mutate ([] if unknown)."""
        if self.hybrid is not None:
            return self.hybrid.groups[group].get_blocks(request_id)
        return self.coordinator.get_blocks(request_id)

    def get_block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """The request's block table of `group` (block ids in token order); O(num blocks)."""
        return [block.block_id for block in self.get_blocks(request_id, group)]

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0 (including evictable cached ones), over every group's pool."""
        return sum(pool.free_block_queue.num_free_blocks for pool in self.pools)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (0.0 to 1.0): the fullest group's."""
        return max(pool.get_usage() for pool in self.pools)

    def stats(self) -> KVCacheStats:
        """Current occupancy (summed over the groups' pools) and cumulative prefix-cache counters."""
        pools = self.pools
        return KVCacheStats(
            num_blocks_total=sum(pool.num_usable_blocks for pool in pools),
            num_blocks_in_use=sum(pool.get_num_in_use_blocks() for pool in pools),
            num_blocks_cached=sum(pool.get_num_cached_blocks() for pool in pools),
            prefix_cache_queried_tokens=self.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=self.prefix_cache_hit_tokens,
        )

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefixes; returns False (and does nothing) while any block is in use."""
        if any(pool.get_num_in_use_blocks() for pool in self.pools):
            return False
        return all([pool.reset_prefix_cache() for pool in self.pools])
