"""The free list of KV-cache blocks, in eviction order."""

from __future__ import annotations

from collections.abc import Iterable

from vx.cache.kv_cache_block import KVCacheBlock


class FreeKVCacheBlockQueue:
    """Doubly linked list of the blocks with `ref_cnt == 0`, head = next to hand out.

    New allocations come from the head. The pool appends a freed cached block at the tail, so
    among cached blocks the one nearest the head is the least recently freed, i.e. the LRU
    eviction candidate; it puts a freed block that caches nothing at the head (`appendleft`), to
    be reused first (see `BlockPool`). A cached block that a new request hits is unlinked from
    wherever it sits in O(1), which is why the links live on the blocks instead of in a
    `collections.deque`. Two sentinel blocks (id -1) remove every empty-list special case; a
    block is in the queue iff its `prev_free` is set.
    """

    __slots__ = ("num_free_blocks", "fake_head", "fake_tail")

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.fake_head = KVCacheBlock(-1)
        self.fake_tail = KVCacheBlock(-1)
        self.num_free_blocks = 0
        prev = self.fake_head
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
            self.num_free_blocks += 1
        prev.next_free = self.fake_tail
        self.fake_tail.prev_free = prev

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Unlink and return the head block; IndexError when empty."""
        block = self.fake_head.next_free
        if block is self.fake_tail or block is None:
            raise IndexError("no free KV-cache blocks")
        nxt = block.next_free
        assert nxt is not None
        self.fake_head.next_free = nxt
        nxt.prev_free = self.fake_head
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Unlink and return the first `n` blocks in queue order, relinking the head once."""
        if n <= 0:
            return []
        if n > self.num_free_blocks:
            raise IndexError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        out: list[KVCacheBlock] = []
        append = out.append
        block = self.fake_head.next_free
        for _ in range(n):
            assert block is not None
            nxt = block.next_free
            block.prev_free = block.next_free = None
            append(block)
            block = nxt
        assert block is not None
        self.fake_head.next_free = block
        block.prev_free = self.fake_head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from anywhere in the queue; ValueError if it is not in it."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Link `block` at the tail (the last to be evicted)."""
        if block.prev_free is not None:
            raise ValueError(f"{block!r} is already in the free queue")
        last = self.fake_tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self.fake_tail
        self.fake_tail.prev_free = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        """Link `block` at the head (the next to be handed out)."""
        if block.prev_free is not None:
            raise ValueError(f"{block!r} is already in the free queue")
        first = self.fake_head.next_free
        assert first is not None
        self.fake_head.next_free = block
        block.prev_free = self.fake_head
        block.next_free = first
        first.prev_free = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All queued blocks, head first (O(n): for tests and debugging)."""
        out: list[KVCacheBlock] = []
        block = self.fake_head.next_free
        while block is not None and block is not self.fake_tail:
            out.append(block)
            block = block.next_free
        return out


# The name DESIGN.md uses.
FreeBlockQueue = FreeKVCacheBlockQueue
