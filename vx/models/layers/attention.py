"""The model-side attention layer: a backend-agnostic call site.

The model computes q, k, v and calls `attn(q, k, v, attn_metadata)`. Which kernel runs and where the
KV cache lives is decided by the GPU side, which binds `impl` and `kv_cache` onto every layer after the
model is loaded (see `vx.gpu.kv_cache.bind_kv_caches`). This module imports no backend on purpose:
models must not depend on vx.gpu.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Attention(nn.Module):
    """Paged attention of one decoder layer over the flattened tokens of a batch.

    q: [T, num_heads*head_dim]; k, v: [T, num_kv_heads*head_dim]; returns [T, num_heads*head_dim].
    """

    # Multi-head latent attention layers (`vx.models.layers.mla`) cache one latent row per token instead of K and V,
    # and only an MLA backend serves them.
    is_mla = False

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int | None = None,
                 layer_idx: int = 0, sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 ) -> None:
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}.")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap  # scores -> cap * tanh(scores / cap) before the softmax (Gemma 2)
        # Bound later by the GPU side; a plain attribute (not a buffer) so state_dict never sees it.
        self.impl: Any = None
        self.kv_cache: torch.Tensor | None = None
        # Its KV-cache group (one per attention kind, when the model mixes them): a step then passes one
        # metadata per group, as a list, and the layer reads its own.
        self.kv_cache_group = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        """Write this step's k/v into the cache and attend q to each request's context."""
        if self.impl is None or self.kv_cache is None:
            raise RuntimeError(
                f"Attention layer {self.layer_idx} has no backend/KV cache bound; call "
                "vx.gpu.kv_cache.bind_kv_caches(model, backend, ...) before running the model.")
        if type(attn_metadata) is list:
            attn_metadata = attn_metadata[self.kv_cache_group]
        return self.impl.forward(self, q, k, v, self.kv_cache, attn_metadata)

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, sliding_window={self.sliding_window}, soft_cap={self.logits_soft_cap}")
