"""The attention backend interface: shared per-step metadata, backend class and per-layer impl.

A backend owns its KV-cache layout and turns the backend-independent `CommonAttentionMetadata` (built by
the ModelRunner each step) into whatever its kernels want; the model passes that result through to every
Attention layer untouched.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class CommonAttentionMetadata:
    """One step's batch layout, backend-independent.

    Request i's tokens are rows [query_start_loc[i], query_start_loc[i+1]) of the flattened batch; its
    context after this step is seq_lens[i] tokens (computed before + scheduled now), stored in the cache
    blocks block_table[i, :]. Tokens at or past num_actual_tokens are padding (slot_mapping -1).
    """

    query_start_loc: torch.Tensor      # int32 [num_reqs+1], on device
    query_start_loc_cpu: torch.Tensor  # same, on CPU
    seq_lens: torch.Tensor             # int32 [num_reqs], on device: context length including this step
    seq_lens_cpu: torch.Tensor
    block_table: torch.Tensor          # int32 [num_reqs, max_blocks_per_req], on device, padded with 0
    slot_mapping: torch.Tensor         # int64 [num_tokens]: block_id*block_size+offset; -1 = padding, skip
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_size: int


class AttentionImpl(ABC):
    """Per-layer attention computation of a backend (stateless apart from the layer's shape)."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None) -> None:
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window

    @abstractmethod
    def forward(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        """Store k/v [T, kv_heads*head_dim] in kv_cache, attend q [T, heads*head_dim]; -> [T, heads*head_dim]."""


class AttentionBackend(ABC):
    """A family of attention kernels with its KV layout and metadata builder."""

    @staticmethod
    @abstractmethod
    def get_name() -> str:
        """Short name, as accepted by `attention_backend=`."""

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's KV-cache tensor."""

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]:
        """The per-layer implementation class."""

    @classmethod
    @abstractmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> Any:
        """Backend-specific metadata for one step, shared by every layer."""
