"""Allocating per-layer KV caches and binding them (with the backend impl) onto the model's Attention layers."""

from __future__ import annotations

import math
import mmap
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from vx.config import hf_kv_cache_dims
from vx.gpu.attention.backend import AttentionBackend
from vx.gpu.attention.kv_format import KVCacheFormat, kv_cache_format
from vx.gpu.attention.torch_backend import TorchAttentionBackend
from vx.kv_spec import KVCacheGroupSpec
from vx.models.layers.attention import Attention
from vx.platform import torch_dtype


def _model_dims(model_config: Any) -> tuple[int, int, int]:
    """(num_layers, cache heads, cache row width) from a vx ModelConfig or a Hugging Face config: num_kv_heads and
    head_dim, or for MLA one latent row of kv_lora_rank + qk_rope_head_dim (`vx.config.hf_kv_cache_dims`)."""
    hf_config = getattr(model_config, "hf_config", None)
    if hf_config is None and hasattr(model_config, "num_layers"):  # plain dims (tests, tools)
        return int(model_config.num_layers), int(model_config.num_kv_heads), int(model_config.head_dim)
    hf_config = model_config if hf_config is None else hf_config
    return (int(hf_config.num_hidden_layers), *hf_kv_cache_dims(hf_config))


def bytes_per_block(model_config: Any, block_size: int, dtype: torch.dtype | str,
                    backend: type[AttentionBackend] = TorchAttentionBackend, kv_cache_dtype: str = "auto") -> int:
    """KV-cache bytes one block costs across all layers (to size num_blocks from a memory budget).

    `dtype` is the model's; the cache stores it as `kv_cache_dtype` says (8-bit formats: a half or a quarter).
    """
    layers, kv_heads, head_dim = _model_dims(model_config)
    fmt = kv_cache_format(kv_cache_dtype)
    per_layer = math.prod(_layer_shape(backend, fmt, 1, block_size, kv_heads, head_dim))
    return layers * per_layer * fmt.cache_dtype(torch_dtype(dtype)).itemsize


def layers_bytes_per_block(layers: Sequence[Attention], block_size: int, dtype: torch.dtype | str,
                           backend: type[AttentionBackend] = TorchAttentionBackend, kv_cache_dtype: str = "auto") -> int:
    """KV-cache bytes one block costs over these Attention layers as built: one rank's share of a model split over
    workers (its stage's layers, its KV heads)."""
    fmt = kv_cache_format(kv_cache_dtype)
    per_block = sum(math.prod(_layer_shape(backend, fmt, 1, block_size, layer.num_kv_heads, layer.head_dim))
                    for layer in layers)
    return per_block * fmt.cache_dtype(torch_dtype(dtype)).itemsize


def _layer_shape(backend: type[AttentionBackend], fmt: KVCacheFormat, num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """One layer's cache shape: the backend's layout with the format's row (head_dim values, or codes + scale)."""
    return backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, fmt.row_width(head_dim))


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's Attention layers ordered by layer_idx (which must be unique)."""
    layers = sorted((m for m in model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_idx)
    idx = [m.layer_idx for m in layers]
    if len(set(idx)) != len(idx):
        raise ValueError(f"Attention layers have duplicate layer_idx values: {idx}.")
    return layers


def bind_kv_caches(model: nn.Module, backend: type[AttentionBackend], num_blocks: int, block_size: int,
                   dtype: torch.dtype | str, device: torch.device | str,
                   kv_cache_dtype: str = "auto", groups: Sequence[KVCacheGroupSpec] = ()) -> list[torch.Tensor]:
    """Allocate a zeroed cache per Attention layer, bind it and a backend impl onto the layer; return them.

    With `groups` (one per attention kind, as the engine core decided), a layer's cache has its
    group's blocks, and the layer reads its group's attention metadata (`Attention.kv_cache_group`).

    `dtype` is the model's; each cache stores K and V in the format `kv_cache_dtype` names, which the impl reads.
    """
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no vx Attention layers to bind a KV cache to.")
    for layer in layers:
        if layer.is_mla != backend.is_mla:
            raise ValueError(f"Attention layer {layer.layer_idx} is {'' if layer.is_mla else 'not '}multi-head latent "
                             f"attention, and the {backend.get_name()!r} attention backend serves "
                             f"{'only' if backend.is_mla else 'no'} such layers.")
    fmt = kv_cache_format(kv_cache_dtype)
    cache_dtype = fmt.cache_dtype(torch_dtype(dtype))
    impl_cls = backend.get_impl_cls()
    caches: list[torch.Tensor] = []
    group_of = {spec.sliding_window: i for i, spec in enumerate(groups)}
    for layer in layers:
        if groups:
            if layer.sliding_window not in group_of:
                raise ValueError(f"Attention layer {layer.layer_idx} (window {layer.sliding_window}) has no KV cache "
                                 "group.")
            layer.kv_cache_group = group_of[layer.sliding_window]
            layer_blocks = groups[layer.kv_cache_group].num_blocks
        else:
            layer.kv_cache_group = 0
            layer_blocks = num_blocks
        shape = _layer_shape(backend, fmt, layer_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        cache = _zeroed(shape, cache_dtype, torch.device(device))
        layer.kv_cache = cache
        layer.impl = impl_cls(layer.num_heads, layer.head_dim, layer.scale, layer.num_kv_heads,
                              sliding_window=layer.sliding_window, kv_cache_dtype=kv_cache_dtype,
                              logits_soft_cap=layer.logits_soft_cap)
        caches.append(cache)
    return caches


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor; on a Linux CPU one that costs no memory until it is written.

    There it lives in its own anonymous private mapping, which the kernel fills with zeros lazily, page by page, as
    blocks are first written: no seconds of memset at start-up for a large cache, and since the block pool hands
    out the lowest block ids first and reuses them, the pages that become resident are those of the blocks in use
    or cached at the peak, not the whole cache. (`torch.empty` gave that only above glibc's mmap threshold, up to
    32 MiB and dynamic: a 48 MiB layer came from `torch.zeros` and was resident from the start.)
    """
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if device.type == "cpu" and sys.platform == "linux" and nbytes >= 1024**2:
        # The tensor holds a reference to the mapping, which is unmapped when the tensor goes.
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)
    return torch.zeros(shape, dtype=dtype, device=device)
