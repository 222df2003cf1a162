"""The model-side call site of Multi-head Latent Attention (DeepSeek-V2): a backend-agnostic layer.

MLA compresses each token's keys and values into one latent row: `kv_lora_rank` values (normed), from which the
up-projection `kv_b_proj` makes every head's non-rotary key part (qk_nope_head_dim) and its value (v_head_dim), plus
`qk_rope_head_dim` rotary key values shared by all heads. The KV cache holds exactly that row per token (one
"head" of kv_lora_rank + qk_rope_head_dim), not the expanded keys and values: 576 values a token in DeepSeek-V2-Lite
instead of 16 heads x (192 + 128).

The model computes q [T, heads, qk_nope_head_dim + qk_rope_head_dim] (its rotary part rotated) and the latent row
[T, kv_lora_rank + qk_rope_head_dim] (the latent normed, the rotary part rotated) and calls `attn(q, row, None, md)`;
an MLA backend (`vx.gpu.attention.mla_backend`) writes the row to the cache and attends, expanding the latent through
`kv_b_proj` or folding kv_b_proj into q and the output (the "absorbed" form). This module imports no backend.
"""

from __future__ import annotations

import torch
from torch import nn

from vx.models.layers.attention import Attention


class MLAAttention(Attention):
    """Multi-head latent attention of one decoder layer; returns [T, num_heads * v_head_dim].

    As an `Attention` it has one cache head of width kv_lora_rank + qk_rope_head_dim (`head_dim`), which is what
    `bind_kv_caches` allocates; `kv_b_proj` is the layer's up-projection, read (never copied) by the backend.
    """

    is_mla = True

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float, kv_b_proj: nn.Module, layer_idx: int = 0) -> None:
        super().__init__(num_heads, kv_lora_rank + qk_rope_head_dim, scale, num_kv_heads=1, layer_idx=layer_idx)
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        # The decoder layer owns kv_b_proj (its checkpoint name); a plain attribute, so it is not registered twice.
        self.__dict__["kv_b_proj"] = kv_b_proj

    def up_projection(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight per head, as views: (W_UK [heads, qk_nope_head_dim, kv_lora_rank],
        W_UV [heads, v_head_dim, kv_lora_rank]); head h's non-rotary key of latent c is W_UK[h] @ c, its value
        W_UV[h] @ c."""
        weight = self.kv_b_proj.weight
        if weight.dim() != 2 or weight.shape[-1] != self.kv_lora_rank:
            raise ValueError(f"MLA layer {self.layer_idx}: kv_b_proj must be a float [heads * (nope + v), "
                             f"kv_lora_rank] weight, got {tuple(weight.shape)} ({weight.dtype}).")
        per_head = weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return per_head[:, :self.qk_nope_head_dim], per_head[:, self.qk_nope_head_dim:]

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
                f"qk_nope={self.qk_nope_head_dim}, qk_rope={self.qk_rope_head_dim}, v={self.v_head_dim}")
