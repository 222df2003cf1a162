"""Paged KV-cache bookkeeping: blocks, the free list, prefix hashing, the pool, the manager, the cache's size.

Pure Python: the KV tensors live in the GPU worker; this package only decides which block
ids each request uses.
"""

from vx.cache.block_hash import BlockHash, hash_block_tokens, update_block_hashes
from vx.cache.block_pool import BlockPool
from vx.cache.block_table_group import BlockTableGroup
from vx.cache.free_block_queue import FreeBlockQueue, FreeKVCacheBlockQueue
from vx.cache.kv_cache_block import KVCacheBlock
from vx.cache.kv_cache_coordinator import HybridKVCacheCoordinator, KVCacheCoordinator, UnitaryKVCacheCoordinator
from vx.cache.kv_cache_manager import CacheRequest, KVCacheManager, KVCacheStats
from vx.cache.kv_cache_size import size_kv_cache

__all__ = [
    "BlockHash",
    "BlockPool",
    "BlockTableGroup",
    "CacheRequest",
    "FreeBlockQueue",
    "FreeKVCacheBlockQueue",
    "HybridKVCacheCoordinator",
    "KVCacheBlock",
    "KVCacheCoordinator",
    "KVCacheManager",
    "KVCacheStats",
    "UnitaryKVCacheCoordinator",
    "hash_block_tokens",
    "size_kv_cache",
    "update_block_hashes",
]
