"""The unit of KV-cache memory that the block pool hands out."""

from __future__ import annotations

from vx.cache.block_hash import BlockHash


class KVCacheBlock:
    """Metadata of one physical KV-cache block (the tensors live in the GPU worker).

    `ref_cnt` counts the requests holding the block; `block_hash` is set once the block is
    full and registered in the prefix cache. `prev_free`/`next_free` are the intrusive links
    of `FreeKVCacheBlockQueue`: keeping them on the block gives O(1) removal from the middle.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        # Only ids of the neighbours: following the links would walk the whole queue.
        prev_id = self.prev_free.block_id if self.prev_free is not None else None
        next_id = self.next_free.block_id if self.next_free is not None else None
        h = self.block_hash.hex()[:12] if self.block_hash is not None else None
        return (f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h}, "
                f"prev={prev_id}, next={next_id})")
