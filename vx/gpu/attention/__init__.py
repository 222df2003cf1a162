"""Attention backends: the interface, the registry of backends by name, and the selector that loads one.

Importing this package imports nothing heavy (the application process reads `registry` without torch): the names
below load when first asked for; a backend's module loads when it is selected, and triton and flash_attn when their
backend first runs, so a test process can still decide TRITON_INTERPRET, and a broken flash_attn install only
disqualifies its own backend.
"""

from __future__ import annotations

from vx.class_path import lazy_names

_LAZY = {
    "AttentionBackend": "vx.gpu.attention.backend",
    "AttentionImpl": "vx.gpu.attention.backend",
    "CommonAttentionMetadata": "vx.gpu.attention.backend",
    "KVCacheWrite": "vx.gpu.attention.backend",
    "backend_problem": "vx.gpu.attention.selector",
    "get_attn_backend": "vx.gpu.attention.selector",
    "load_backend": "vx.gpu.attention.selector",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_names(__name__, _LAZY)
