"""Decode graphs: their sizes and buffers, the background compiler, CUDA capture, the AOT cache and its loader.

A model runner asks `build_decode_graphs` for its graphs. The package itself imports nothing heavy; its names
load when first asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "DecodeGraphs": "vx.gpu.graphs.decode_graphs",
    "build_decode_graphs": "vx.gpu.graphs.build",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'vx.gpu.graphs' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
