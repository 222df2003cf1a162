"""The attention backend interface: shared per-step metadata, backend class and per-layer impl.

A backend owns its KV-cache layout and turns the backend-independent `CommonAttentionMetadata` (built by
the ModelRunner each step) into whatever its kernels want; the model passes that result through to every
Attention layer untouched. What every vx backend shares is written here once: the KV layout
[2, num_blocks, block_size, num_kv_heads, row] (row: head_dim values, or a quantized row, see `kv_format`), the
write of new k/v by slot, the zeroed padding rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from vx.gpu.attention.kv_format import kv_cache_format


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


@dataclass
class DecodeGraphMetadata:
    """A decode-only step's attention inputs as tensors only, for a compiled decode graph (`vx.gpu.graphs`).

    Row i is one request's single new token: its k/v go to slot_mapping[i], and it attends to the first
    seq_lens[i] tokens of its blocks block_table[i]. Padding rows write the null block's first slot and attend to
    it alone. Backends whose `supports_decode_graphs` is True take it in place of their own metadata.
    """

    slot_mapping: torch.Tensor  # int64 [B]
    block_table: torch.Tensor   # int32 [B, max_blocks_per_seq], contiguous
    seq_lens: torch.Tensor      # int32 [B]


@dataclass
class KVCacheWrite:
    """Where one step's new k/v rows go in the cache: built once per step, applied by every layer."""

    slots: torch.Tensor         # int64 [num written rows]: the cache slot of each written row
    rows: torch.Tensor | None   # int64: the batch rows written, or None = rows [0, len(slots))

    @classmethod
    def from_common(cls, common: CommonAttentionMetadata) -> KVCacheWrite:
        """The actual tokens' slots, without the padding ones (slot -1)."""
        slots = common.slot_mapping[:common.num_actual_tokens].long()
        valid = slots >= 0
        if bool(valid.all()):  # one host sync per step, not per layer
            return cls(slots, None)
        rows = valid.nonzero().squeeze(1)
        return cls(slots[rows], rows)

    def apply(self, key_slots: torch.Tensor, value_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [T, kv_heads, row] into the caches' slot views (see `slot_views`).

        Rows of a quantized cache come already in its format (`KVCacheFormat.store`); others are cast to its dtype.
        """
        if self.rows is None:
            n = self.slots.shape[0]
            k, v = k[:n], v[:n]
        else:
            k, v = k.index_select(0, self.rows), v.index_select(0, self.rows)
        for cache, x in ((key_slots, k), (value_slots, v)):
            as_bytes(cache).index_copy_(0, self.slots, as_bytes(x.to(cache.dtype)))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor viewed as uint8 (torch's CPU copy and index kernels lack float8); others as they are."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def slot_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's key and value caches as [num_blocks * block_size, kv_heads, row] views: first index = slot."""
    num_kv_heads, row = kv_cache.shape[-2:]
    return kv_cache[0].view(-1, num_kv_heads, row), kv_cache[1].view(-1, num_kv_heads, row)


class AttentionImpl(ABC):
    """Per-layer attention computation of a backend (stateless apart from the layer's shape)."""

    # Whether the impl applies attention-logit soft-capping (Gemma 2: scores -> cap * tanh(scores / cap)).
    supports_logits_soft_cap = False

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None) -> None:
        if logits_soft_cap is not None and not self.supports_logits_soft_cap:
            raise ValueError(f"{type(self).__name__} does not apply attention-logit soft-capping "
                             f"(logits_soft_cap={logits_soft_cap}, Gemma 2): use attention_backend='torch' or 'cpu'.")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.kv_format = kv_cache_format(kv_cache_dtype)  # how its kv_cache stores K and V

    @abstractmethod
    def forward(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        """Store k/v [T, kv_heads*head_dim] in kv_cache, attend q [T, heads*head_dim]; -> [T, heads*head_dim]."""

    def new_output(self, q: torch.Tensor, num_actual_tokens: int) -> torch.Tensor:
        """The [T, heads*head_dim] output buffer; its padding rows (past the actual tokens) are zeroed."""
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        if q.shape[0] > num_actual_tokens:
            out[num_actual_tokens:].zero_()  # a defined output, never attended
        return out


class AttentionBackend(ABC):
    """A family of attention kernels with its KV layout and metadata builder.

    The selector asks `unavailable_reason`, `unsupported_reason` and `is_paged`; their defaults describe a
    backend that runs wherever torch does, for any shape, straight from a cache in the model dtype.
    """

    # Whether it serves multi-head latent attention layers (and only those): their cache is one latent row per token.
    is_mla = False

    @staticmethod
    @abstractmethod
    def get_name() -> str:
        """Short name, as accepted by `attention_backend=` (its row in `vx.gpu.attention.registry`)."""

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's KV-cache tensor: keys and values, each [num_blocks, block_size, kv_heads, head_dim].

        For a quantized cache `head_dim` is the format's row width (`KVCacheFormat.row_width`).
        """
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]:
        """The per-layer implementation class."""

    @classmethod
    @abstractmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> Any:
        """Backend-specific metadata for one step, shared by every layer."""

    @staticmethod
    def unavailable_reason(device_type: str) -> str | None:
        """Why the backend cannot run on `device_type` ('cpu'/'cuda') in this process (None = it can)."""
        return None

    @staticmethod
    def unsupported_reason(*, dtype: torch.dtype | None = None, head_dim: int | None = None,
                           block_size: int | None = None, kv_cache_dtype: str | None = None) -> str | None:
        """Why the backend cannot serve this shape (None = it can); arguments left at None are not checked.

        The default serves any shape, from a cache in the model dtype only: a backend that reads a quantized cache
        says so in its own override.
        """
        return quantized_cache_refusal("this backend", kv_cache_dtype)

    @staticmethod
    def supports_decode_graphs(device_type: str) -> bool:
        """Whether its layers take `DecodeGraphMetadata`, so that decode steps can run compiled graphs."""
        return False

    @staticmethod
    def is_paged(block_size: int) -> bool:
        """Whether it attends straight from cache blocks of this size (False: it gathers a copy every layer)."""
        return True


def quantized_cache_refusal(backend: str, kv_cache_dtype: str | None) -> str | None:
    """The reason a backend that reads only model-dtype caches gives for a quantized `kv_cache_dtype`."""
    if kv_cache_dtype is None or not kv_cache_format(kv_cache_dtype).quantized:
        return None
    return f"{backend} reads no {kv_cache_dtype} KV cache (kv_cache_dtype='auto' only)"
