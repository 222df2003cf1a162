"""How the KV cache stores keys and values (`kv_cache_dtype`): in the model dtype, or in 8 bits.

One layer's cache is [2, num_blocks, block_size, num_kv_heads, row]: a row is one token's key (or value) for one kv
head. The formats differ only in the row:

* "auto": head_dim values in the model dtype.
* "fp8_e4m3": head_dim float8 e4m3 codes (torch.float8_e4m3fn, as vLLM's fp8 cache), value = code * scale with one
  fixed scale for every K and V (see `Fp8E4M3Format.tensor_scale`); values beyond the e4m3 range saturate at +-448.
* "int8": head_dim int8 codes, then the row's own float32 scale (absmax / 127) in the next 4 bytes: value = code *
  scale. Keeping the scale inside the row keeps one tensor per layer (the model's Attention layer holds one), each
  block self-contained, and every backend's slot addressing as it is; it costs 4 bytes per row (6% at head_dim 64).

Every write quantizes here, in torch (`store`): the backends' caches then hold the same bytes whichever backend wrote
them. A backend dequantizes what it reads, with `load` or in its own kernel from the codes.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

import torch

FP8_E4M3_MAX = 448.0
"""The largest finite float8 e4m3fn value: anything larger is stored as this (e4m3fn has no infinity)."""

INT8_SCALE_BYTES = 4
"""An int8 row's float32 scale, stored after its head_dim codes."""


class KVCacheFormat:
    """"auto": the model dtype, stored as it is."""

    name = "auto"
    quantized = False
    # value = code * tensor_scale (times the row's own scale in int8): one factor for every K and V of the cache,
    # which kernels fold into the softmax scale (K) and the output (V).
    tensor_scale = 1.0

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The cache tensor's dtype for a model computing in `model_dtype`."""
        return model_dtype

    def row_width(self, head_dim: int) -> int:
        """Elements of the cache's last dimension for one (token, kv head)."""
        return head_dim

    def unsupported_reason(self, head_dim: int | None = None) -> str | None:
        """Why the format cannot store heads of this width (None = it can)."""
        return None

    def store(self, x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
        """Rows to write: x [..., head_dim] -> [..., row_width] in `cache_dtype`."""
        return x.to(cache_dtype)

    def load(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Values read back: rows [..., row_width] (the cache's dtype) -> [..., head_dim] in `dtype`."""
        return rows.to(dtype)


class Fp8E4M3Format(KVCacheFormat):
    """float8 e4m3 codes with one per-tensor scale: half a bf16 cache, a quarter of a float32 one."""

    name = "fp8_e4m3"
    quantized = True
    # e4m3's relative precision (3 mantissa bits, <= 6.25% rounding error) is the same anywhere in its normal range
    # [2^-6, 448]; a scale only slides that window. 1.0 (vLLM's default) holds what we measured with margin: |K| <= 22
    # and |V| <= 15 in every layer of SmolLM2-135M over 3,000 characters of text, |K|, |V| <= 10 in the tiny test
    # models. A larger value saturates at 448 instead of becoming NaN.
    tensor_scale = 1.0

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.float8_e4m3fn

    def store(self, x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
        x = x.float() if self.tensor_scale == 1.0 else x.float() / self.tensor_scale
        return x.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)

    def load(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        values = rows.to(dtype)
        return values if self.tensor_scale == 1.0 else values * self.tensor_scale


class Int8Format(KVCacheFormat):
    """int8 codes with a float32 scale per (token, kv head) row, stored after the codes."""

    name = "int8"
    quantized = True

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.int8

    def row_width(self, head_dim: int) -> int:
        return head_dim + INT8_SCALE_BYTES

    def unsupported_reason(self, head_dim: int | None = None) -> str | None:
        if head_dim is not None and head_dim % INT8_SCALE_BYTES:
            # The scale is read as a float32 straight from the row: it must sit 4-byte aligned.
            return f"an int8 KV cache needs head_dim divisible by {INT8_SCALE_BYTES}, got {head_dim}"
        return None

    def store(self, x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
        head_dim = x.shape[-1]
        x = x.float()
        scale = x.abs().amax(-1, keepdim=True) / 127.0
        rows = torch.empty(*x.shape[:-1], self.row_width(head_dim), dtype=torch.int8, device=x.device)
        # An all-zero row keeps scale 0 and codes 0 (no division by zero).
        rows[..., :head_dim] = (x / torch.where(scale > 0, scale, 1.0)).round_().clamp_(-127, 127)
        rows[..., head_dim:].view(torch.float32).copy_(scale)
        return rows

    def load(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        head_dim = rows.shape[-1] - INT8_SCALE_BYTES
        codes, scale = rows[..., :head_dim], row_scales(rows)
        return (codes.float() * scale).to(dtype)


def row_scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scales [..., 1] of int8 rows [..., head_dim + 4] (a view: the rows' last 4 bytes)."""
    return rows[..., rows.shape[-1] - INT8_SCALE_BYTES:].view(torch.float32)


KV_CACHE_FORMATS: Mapping[str, KVCacheFormat] = MappingProxyType(
    {f.name: f for f in (KVCacheFormat(), Fp8E4M3Format(), Int8Format())})
"""kv_cache_dtype name -> its format (the names are vx.gpu.attention.registry.KV_CACHE_DTYPES)."""


def kv_cache_format(name: str) -> KVCacheFormat:
    """The format `kv_cache_dtype=name` stores the cache in."""
    try:
        return KV_CACHE_FORMATS[name]
    except KeyError:
        raise ValueError(f"Unknown kv_cache_dtype {name!r}; choose one of: {', '.join(KV_CACHE_FORMATS)}.") from None
