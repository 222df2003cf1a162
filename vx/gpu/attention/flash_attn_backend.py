"""Paged attention on FlashAttention-2 (`flash_attn.flash_attn_varlen_func`), CUDA only.

KV layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim], the torch/triton layout: its
halves kv_cache[0] / kv_cache[1] are exactly the [num_blocks, page_block_size, nheads_k, headdim] tensors
FA2 takes as paged k and v. New k/v are written with torch indexing (one host sync per step to drop the
padding slots, as in the torch backend).

FA2 constraints (flash_attn 2.x, `flash_api.cpp` / `flash_attn_interface.py`):
  * its `block_table=` (paged KV) path requires page_block_size % 256 == 0. With such block sizes this
    backend attends straight from the cache; with smaller ones (vx's default 16) it gathers each request's
    context into a contiguous [sum(seq_lens), Hk, D] copy per layer (indices built once per step) and calls
    the same function without a block table: correct, but it moves the whole context each layer, so
    `attention_backend='auto'` prefers triton there;
  * float16/bfloat16 only, head_dim <= 256 and a multiple of 8 (the cache cannot be padded), sm80+;
  * K/V in the model dtype only: FA2 reads no fp8/int8 cache (FA3's fp8 path needs Hopper and another build), so a
    quantized `kv_cache_dtype` is refused (`unsupported_reason`) and 'auto' takes triton instead;
  * causal masks align bottom-right (query j of a q_len chunk sees keys <= seq_len - q_len + j), which
    is vx's chunked-prefill semantics; a sliding window of W (the last W positions, itself included) is
    window_size=(W - 1, 0).
flash_attn is imported lazily: this module imports anywhere, and `unavailable_reason` says why it cannot run.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import torch

from vx.gpu.attention.backend import (AttentionBackend, AttentionImpl, CommonAttentionMetadata, KVCacheWrite,
                                      quantized_cache_refusal, slot_views)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
PAGED_BLOCK_MULTIPLE = 256  # FA2's paged-KV page size requirement


@lru_cache(maxsize=None)
def _varlen_func() -> tuple[Callable[..., torch.Tensor], bool]:
    """(flash_attn_varlen_func, whether it takes block_table=), imported on first use."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func, "block_table" in inspect.signature(flash_attn_varlen_func).parameters


@dataclass
class FlashAttnMetadata:
    """Per-step tensors for the flash_attn backend (built once, read by every layer)."""

    num_actual_tokens: int
    cu_seqlens_q: torch.Tensor       # int32 [num_reqs+1], device
    cu_seqlens_k: torch.Tensor       # int32 [num_reqs+1], device: prefix sums of seq_lens
    max_query_len: int
    max_seq_len: int
    block_table: torch.Tensor        # int32 [num_reqs, max_blocks], device
    kv_write: KVCacheWrite           # where the step's new k/v go
    paged: bool                      # attend from the cache through block_table (else gather ctx_slots)
    ctx_slots: torch.Tensor | None   # int64 [sum(seq_lens)]: cache slot of every context position


class FlashAttnBackend(AttentionBackend):
    """FlashAttention-2 varlen attention over the paged cache (direct for block_size % 256 == 0)."""

    @staticmethod
    def get_name() -> str:
        return "flash_attn"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return FlashAttnImpl

    @staticmethod
    def unavailable_reason(device_type: str) -> str | None:
        """Why the backend cannot run on `device_type` in this process (None = it can)."""
        if device_type != "cuda":
            return f"flash_attn needs CUDA, not device {device_type!r}"
        if not torch.cuda.is_available():
            return "flash_attn needs CUDA, and torch sees no CUDA device"
        if torch.cuda.get_device_capability()[0] < 8:
            return "FlashAttention-2 needs an sm80+ (Ampere or newer) GPU"
        try:
            _varlen_func()
        except Exception as e:  # not installed, or built against another torch/CUDA
            return f"flash_attn is not importable ({type(e).__name__}: {e})"
        return None

    @staticmethod
    def unsupported_reason(*, dtype: torch.dtype | None = None, head_dim: int | None = None,
                           block_size: int | None = None, kv_cache_dtype: str | None = None) -> str | None:
        """Why this backend cannot serve the given shape (None = it can); unknown arguments pass."""
        refusal = quantized_cache_refusal("FlashAttention-2", kv_cache_dtype)
        if refusal is not None:
            return refusal + "; use attention_backend='triton' or 'torch'"
        if dtype is not None and dtype not in SUPPORTED_DTYPES:
            return f"flash_attn supports float16/bfloat16 only, not {dtype} (use triton or torch for float32)"
        if head_dim is not None and not (0 < head_dim <= 256 and head_dim % 8 == 0):
            return f"flash_attn needs head_dim <= 256 and a multiple of 8, got {head_dim}"
        if block_size is not None and block_size < 1:
            return f"block_size must be positive, got {block_size}"
        return None

    @staticmethod
    def is_paged(block_size: int) -> bool:
        """Whether FA2 can read this block size straight from the cache (else a per-layer gather)."""
        return block_size % PAGED_BLOCK_MULTIPLE == 0

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> FlashAttnMetadata:
        """Prefix sums of the lengths, the write slots and, below 256-token blocks, the gather indices."""
        n = common.num_actual_tokens
        bs = common.block_size
        device = common.block_table.device
        seq_lens = common.seq_lens[:common.num_reqs].to(torch.int32)
        cu_k = torch.zeros(common.num_reqs + 1, dtype=torch.int32, device=device)
        torch.cumsum(seq_lens, 0, out=cu_k[1:])
        block_table = common.block_table[:common.num_reqs].to(torch.int32)
        # A flash_attn too old for block_table= still works through the gather.
        paged = cls.is_paged(bs) and _varlen_func()[1]
        ctx_slots = None
        if not paged:
            seq_cpu = common.seq_lens_cpu[:common.num_reqs].long()
            total = int(seq_cpu.sum())
            req = torch.repeat_interleave(torch.arange(common.num_reqs), seq_cpu).to(device)
            starts = (torch.cumsum(seq_cpu, 0) - seq_cpu).to(device)
            pos = torch.arange(total, device=device) - starts[req]
            ctx_slots = block_table[req, pos // bs].long() * bs + pos % bs
        return FlashAttnMetadata(
            num_actual_tokens=n, cu_seqlens_q=common.query_start_loc[:common.num_reqs + 1].to(torch.int32),
            cu_seqlens_k=cu_k, max_query_len=common.max_query_len, max_seq_len=common.max_seq_len,
            block_table=block_table, kv_write=KVCacheWrite.from_common(common), paged=paged, ctx_slots=ctx_slots)


class FlashAttnImpl(AttentionImpl):
    """Per-layer forward of the flash_attn backend."""

    def forward(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: FlashAttnMetadata) -> torch.Tensor:
        """Write k/v at the step's slots, then one flash_attn_varlen_func call for the whole batch."""
        md = attn_metadata
        num_tokens = q.shape[0]
        n = md.num_actual_tokens
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        if kv_cache.dtype not in SUPPORTED_DTYPES or self.kv_format.quantized:
            raise ValueError(f"flash_attn supports float16/bfloat16 KV caches only, got {kv_cache.dtype} "
                             f"(kv_cache_dtype={self.kv_format.name!r}); use attention_backend='triton' or 'torch'.")
        k = k.reshape(num_tokens, hk, d)
        v = v.reshape(num_tokens, hk, d)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        flat_k, flat_v = slot_views(kv_cache)
        md.kv_write.apply(flat_k, flat_v, k, v)

        out = self.new_output(q, n)
        if n == 0:
            return out
        fn = _varlen_func()[0]
        window = (-1, -1) if self.sliding_window is None else (self.sliding_window - 1, 0)
        q3 = q[:n].reshape(n, h, d).to(kv_cache.dtype)
        kwargs: dict[str, Any] = dict(cu_seqlens_q=md.cu_seqlens_q, cu_seqlens_k=md.cu_seqlens_k,
                                      max_seqlen_q=md.max_query_len, max_seqlen_k=md.max_seq_len,
                                      softmax_scale=self.scale, causal=True, window_size=window)
        if md.paged:
            o = fn(q3, key_cache, value_cache, block_table=md.block_table, **kwargs)
        else:
            assert md.ctx_slots is not None
            o = fn(q3, flat_k.index_select(0, md.ctx_slots), flat_v.index_select(0, md.ctx_slots), **kwargs)
        out[:n] = o.reshape(n, h * d)
        return out
