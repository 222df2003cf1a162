"""Attention backends: the interface, and the selector that loads one by name.

Importing this package imports no backend module, nor triton or flash_attn: a backend's module loads when
it is selected (the names and their modules are listed once, in `vx.attention_backends`), and triton and
flash_attn load when their backend first runs, so a test process can still decide TRITON_INTERPRET, and a
broken flash_attn install only disqualifies its own backend.
"""

from __future__ import annotations

from vx.gpu.attention.backend import AttentionBackend, AttentionImpl, CommonAttentionMetadata, KVCacheWrite
from vx.gpu.attention.selector import backend_problem, get_attn_backend, load_backend

__all__ = ["AttentionBackend", "AttentionImpl", "CommonAttentionMetadata", "KVCacheWrite", "backend_problem",
           "get_attn_backend", "load_backend"]
