"""The attention backends by name: what `attention_backend=` accepts, and where each backend's class lives.

This is the one list of backend names. It imports nothing, so the config validates against it in the
application's process (which never imports torch); `vx.gpu.attention` imports a backend's module only when
that backend is asked for.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

AUTO = "auto"
"""Not a backend: asks the selector for the best one available on the device."""

BACKEND_CLASSES: Mapping[str, str] = MappingProxyType({
    "torch": "vx.gpu.attention.torch_backend:TorchAttentionBackend",
    "cpu": "vx.gpu.attention.cpu_backend:CpuAttentionBackend",
    "triton": "vx.gpu.attention.triton_backend:TritonAttentionBackend",
    "flash_attn": "vx.gpu.attention.flash_attn_backend:FlashAttnBackend",
    "mla": "vx.gpu.attention.mla_backend:MLAAttentionBackend",
})
"""Backend name -> "module:class" of its `AttentionBackend`. "mla" serves multi-head latent attention models
(DeepSeek-V2) and only those; 'auto' picks it for them."""

ATTENTION_BACKEND_NAMES: tuple[str, ...] = (AUTO, *BACKEND_CLASSES)
"""Every value `attention_backend=` accepts."""
