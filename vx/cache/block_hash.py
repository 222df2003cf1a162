"""Content hashes of full KV-cache blocks, chained so that a hash names a whole prefix."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgspec

BlockHash = bytes
"""SHA-256 digest (32 bytes) of (parent block hash, block token ids, extra keys)."""

# msgpack of the 3-tuple is self-delimiting, so distinct inputs give distinct byte strings
# (unlike, say, joining str() forms); one shared encoder avoids per-call setup.
_encode = msgspec.msgpack.Encoder().encode
_sha256 = hashlib.sha256


def hash_block_tokens(parent_block_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple[Any, ...] | None = None) -> BlockHash:
    """Hash one full block given the hash of the block before it (None for the first block).

    `token_ids` must be a list or tuple of ints (both hash the same). `extra_keys` is for
    anything besides the tokens that changes the KV (e.g. a LoRA id or a cache salt); it must
    be msgpack-encodable.
    """
    return _sha256(_encode((parent_block_hash, token_ids, extra_keys))).digest()


def update_block_hashes(block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        extra_keys: tuple[Any, ...] | None = None) -> None:
    """Append to `block_hashes` the hashes of the blocks of `token_ids` that are newly full.

    Hashing resumes at block `len(block_hashes)`, so calling this every step as a request
    grows costs O(1) unless a block just filled up. The trailing partial block is never
    hashed. `extra_keys` goes into every block's hash.
    """
    num_full = len(token_ids) // block_size
    start = len(block_hashes)
    if start >= num_full:
        return
    parent = block_hashes[-1] if start else None
    append = block_hashes.append
    for begin in range(start * block_size, num_full * block_size, block_size):
        block = token_ids[begin:begin + block_size]
        parent = _sha256(_encode((parent, block, extra_keys))).digest()
        append(parent)
