"""Allocating per-layer KV caches and binding them (with the backend impl) onto the model's Attention layers."""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch import nn

from vx.config import hf_head_dim, hf_num_kv_heads
from vx.gpu.attention.backend import AttentionBackend
from vx.gpu.attention.torch_backend import TorchAttentionBackend
from vx.models.layers.attention import Attention
from vx.platform import torch_dtype


def _model_dims(model_config: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) from a vx ModelConfig or a Hugging Face config."""
    if hasattr(model_config, "num_layers"):
        return int(model_config.num_layers), int(model_config.num_kv_heads), int(model_config.head_dim)
    return int(model_config.num_hidden_layers), hf_num_kv_heads(model_config), hf_head_dim(model_config)


def bytes_per_block(model_config: Any, block_size: int, dtype: torch.dtype | str,
                    backend: type[AttentionBackend] = TorchAttentionBackend) -> int:
    """KV-cache bytes one block costs across all layers (to size num_blocks from a memory budget)."""
    layers, kv_heads, head_dim = _model_dims(model_config)
    per_layer = math.prod(backend.get_kv_cache_shape(1, block_size, kv_heads, head_dim))
    return layers * per_layer * torch_dtype(dtype).itemsize


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's Attention layers ordered by layer_idx (which must be unique)."""
    layers = sorted((m for m in model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_idx)
    idx = [m.layer_idx for m in layers]
    if len(set(idx)) != len(idx):
        raise ValueError(f"Attention layers have duplicate layer_idx values: {idx}.")
    return layers


def bind_kv_caches(model: nn.Module, backend: type[AttentionBackend], num_blocks: int, block_size: int,
                   dtype: torch.dtype | str, device: torch.device | str) -> list[torch.Tensor]:
    """Allocate a zeroed cache per Attention layer, bind it and a backend impl onto the layer; return them."""
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no vx Attention layers to bind a KV cache to.")
    impl_cls = backend.get_impl_cls()
    caches: list[torch.Tensor] = []
    for layer in layers:
        shape = backend.get_kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        cache = _zeroed(shape, torch_dtype(dtype), torch.device(device))
        layer.kv_cache = cache
        layer.impl = impl_cls(layer.num_heads, layer.head_dim, layer.scale, layer.num_kv_heads,
                              sliding_window=layer.sliding_window)
        caches.append(cache)
    return caches


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor; on Linux CPUs without writing it: gigabytes of memset take seconds at start-up.

    Allocations this large are fresh anonymous mmaps there, which the kernel fills with zeros lazily, page by
    page, as blocks are first written; so the cache costs no time and no memory until it is used.
    """
    numel = 1
    for d in shape:
        numel *= d
    if device.type == "cpu" and sys.platform == "linux" and numel * dtype.itemsize >= 64 * 1024**2:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)
