"""Multi-head Latent Attention (DeepSeek-V2) over a paged cache of latent rows.

KV layout per layer: [num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]: one row per token, the normed
compressed kv then the rotated shared key part (`vx.models.layers.mla`); no separate value cache. Each step a layer
writes its new rows at `slot_mapping`, then:
  * prefills and prefill chunks (more than one query) expand their context's latent rows through kv_b_proj into
    per-head keys (non-rotary part | shared rotary part) and values and run SDPA, as Hugging Face computes MLA; a
    chunk that continues a cached prefix reads its context's rows from the cache, one with no prefix its own rows;
  * decodes (one query) use the absorbed form, which never expands the cache: q_nope is folded through W_UK into
    the latent space (q_lat, kv_lora_rank wide), scores are q_lat . latent + q_pe . k_rope, the softmax-weighted
    latent rows are folded back through W_UV. On CUDA a Triton kernel (mla_kernels.py) does the middle part in place
    over the paged cache; elsewhere torch gathers each length group's blocks (as the torch backend does).
The batch split and the gather indices are the torch backend's (`TorchAttentionBackend.build_metadata`).

Refused: a quantized cache (kv_cache_dtype other than 'auto'), decode graphs (decodes run eagerly).
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from vx.gpu.attention.backend import AttentionBackend, AttentionImpl, CommonAttentionMetadata, quantized_cache_refusal
from vx.gpu.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata

_DECODE_KERNELS = ("auto", "torch", "triton")


@lru_cache(maxsize=None)
def _triton_kernels() -> ModuleType:
    """mla_kernels, imported on first use so that selecting the backend never imports triton."""
    from vx.gpu.attention import mla_kernels

    return mla_kernels


class MLAAttentionBackend(AttentionBackend):
    """MLA over a latent-row cache: torch prefill (expanded), absorbed decode (Triton on CUDA, torch elsewhere)."""

    is_mla = True

    @staticmethod
    def get_name() -> str:
        return "mla"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """One latent cache, no key/value pair: [num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]."""
        return (num_blocks, block_size, num_kv_heads, head_dim)

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return MLAAttentionImpl

    @staticmethod
    def unsupported_reason(*, dtype: torch.dtype | None = None, head_dim: int | None = None,
                           block_size: int | None = None, kv_cache_dtype: str | None = None) -> str | None:
        """Any shape, from a cache in the model dtype."""
        return quantized_cache_refusal("the mla backend", kv_cache_dtype)

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        """The torch backend's split into prefills and decode length groups, with their gather indices."""
        return TorchAttentionBackend.build_metadata(common)


def mla_decode_torch(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference of `mla_kernels.mla_decode_triton` (same arguments): the softmax-weighted latent rows
    [B, heads, kv_lora_rank] of each request's first seq_lens[b] cached positions, gathered whole blocks at a time."""
    num_reqs, _, rank = q_lat.shape
    block_size, row = kv_cache.shape[1], kv_cache.shape[-1]
    length = block_table.shape[1] * block_size
    ctx = kv_cache.index_select(0, block_table.reshape(-1).long()).view(num_reqs, length, row).to(q_lat.dtype)
    latent, rope = ctx[..., :rank], ctx[..., rank:]
    scores = (torch.matmul(q_lat, latent.transpose(1, 2)) + torch.matmul(q_pe, rope.transpose(1, 2))).float() * scale
    visible = torch.arange(length, device=q_lat.device)[None, None, :] < seq_lens.reshape(-1, 1, 1)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).to(q_lat.dtype)
    return torch.matmul(probs, latent)


class MLAAttentionImpl(AttentionImpl):
    """Per-layer forward of the MLA backend; the layer (`MLAAttention`) gives the dims and kv_b_proj.

    `decode_kernel`: "triton" (the paged kernel), "torch" (gathered), or "auto": triton on a CUDA cache when triton
    is installed, else torch.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, decode_kernel: str = "auto") -> None:
        super().__init__(num_heads, head_dim, scale, num_kv_heads, sliding_window, kv_cache_dtype, logits_soft_cap)
        if num_kv_heads != 1:
            raise ValueError(f"An MLA cache has one latent head, got num_kv_heads={num_kv_heads}.")
        if sliding_window is not None:
            raise ValueError(f"The mla backend attends in full; sliding_window={sliding_window} is not supported.")
        if self.kv_format.quantized:
            raise ValueError(f"The mla backend reads no {kv_cache_dtype} KV cache (kv_cache_dtype='auto' only).")
        if decode_kernel not in _DECODE_KERNELS:
            raise ValueError(f"decode_kernel={decode_kernel!r}: expected one of {_DECODE_KERNELS}.")
        self.decode_kernel = decode_kernel

    def _decode_fn(self, kv_cache: torch.Tensor) -> Any:
        kernel = self.decode_kernel
        if kernel == "auto":
            cuda = kv_cache.device.type == "cuda" and importlib.util.find_spec("triton") is not None
            kernel = "triton" if cuda else "torch"
        return _triton_kernels().mla_decode_triton if kernel == "triton" else mla_decode_torch

    def forward(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, kv_cache: torch.Tensor,
                attn_metadata: TorchAttentionMetadata) -> torch.Tensor:
        """q [T, heads, nope + rope]; k: the latent rows [T, kv_lora_rank + rope] to cache (v unused) ->
        [T, heads * v_head_dim]."""
        md = attn_metadata
        num_tokens = q.shape[0]
        h, row = self.num_heads, self.head_dim
        q = q.reshape(num_tokens, h, -1)
        k = k.reshape(num_tokens, row)
        cache_rows = kv_cache.view(-1, row)
        write = md.kv_write
        new_rows = k[:write.slots.shape[0]] if write.rows is None else k.index_select(0, write.rows)
        cache_rows.index_copy_(0, write.slots, new_rows.to(cache_rows.dtype))

        out = q.new_empty(num_tokens, h * layer.v_head_dim)
        if num_tokens > md.num_actual_tokens:
            out[md.num_actual_tokens:].zero_()  # a defined output, never attended
        if md.num_decodes:
            self._decode(layer, q, kv_cache, md, out)
        for i, p in enumerate(md.prefills):
            rows = k[p.start:p.end] if p.ctx_slots is None else cache_rows.index_select(0, p.ctx_slots)
            keys, values = _expand(layer, rows.to(q.dtype))
            o = F.scaled_dot_product_attention(
                q[p.start:p.end].transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0), attn_mask=md.prefill_mask(i, None, q.device),
                is_causal=p.ctx_slots is None, scale=self.scale)
            out[p.start:p.end] = o[0].transpose(0, 1).reshape(p.q_len, -1)
        return out

    def _decode(self, layer: Any, q: torch.Tensor, kv_cache: torch.Tensor, md: TorchAttentionMetadata,
                out: torch.Tensor) -> None:
        """Absorbed single-token attention, one call per length group: W_UK into q, attend the latent rows, W_UV."""
        w_uk, w_uv = layer.up_projection()
        nope = layer.qk_nope_head_dim
        decode = self._decode_fn(kv_cache)
        for grp in md.decode_groups:
            qd = q[grp.rows]
            q_lat = torch.einsum("bhd,hdr->bhr", qd[..., :nope], w_uk)
            o_lat = decode(q_lat, qd[..., nope:], kv_cache, grp.blocks, grp.seq_lens.reshape(-1), self.scale)
            out[grp.rows] = torch.einsum("bhr,hvr->bhv", o_lat, w_uv).reshape(grp.size, -1)


def _expand(layer: Any, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent rows [L, kv_lora_rank + rope] -> per-head keys [L, heads, nope + rope] (the rotary part shared by all
    heads) and values [L, heads, v_head_dim], through kv_b_proj."""
    length = rows.shape[0]
    latent, rope = rows[:, :layer.kv_lora_rank], rows[:, layer.kv_lora_rank:]
    kv = layer.kv_b_proj(latent).view(length, layer.num_heads, layer.qk_nope_head_dim + layer.v_head_dim)
    k_nope, values = kv.split([layer.qk_nope_head_dim, layer.v_head_dim], dim=-1)
    keys = torch.cat((k_nope, rope[:, None, :].expand(length, layer.num_heads, rope.shape[-1])), dim=-1)
    return keys, values
