"""Attention backends and the selector that picks one by name."""

from __future__ import annotations

from vx.gpu.attention.backend import AttentionBackend, AttentionImpl, CommonAttentionMetadata
from vx.gpu.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata

_PLANNED = ("triton", "flash_attn")


def get_attn_backend(name: str, device: str) -> type[AttentionBackend]:
    """The backend class for `name` ('auto' or 'torch' for now) on `device` ('cpu' or 'cuda')."""
    if name in ("auto", "torch"):
        return TorchAttentionBackend
    if name in _PLANNED:
        raise ValueError(f"attention_backend={name!r} is not available yet; use 'auto' or 'torch'.")
    raise ValueError(f"Unknown attention_backend {name!r}; choose one of: auto, torch, {', '.join(_PLANNED)}.")


__all__ = ["AttentionBackend", "AttentionImpl", "CommonAttentionMetadata", "TorchAttentionBackend",
           "TorchAttentionMetadata", "get_attn_backend"]
