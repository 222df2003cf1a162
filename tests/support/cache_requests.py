"""A minimal `CacheRequest` for KV-cache tests: an id, its tokens, and what the cache manager reads and writes."""

from __future__ import annotations


class Req:
    """Minimal CacheRequest."""

    def __init__(self, request_id: str, tokens: list[int]) -> None:
        self.request_id = request_id
        self.all_token_ids = list(tokens)
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)
