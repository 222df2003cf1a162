"""Decode graphs: their sizes and buffers, the background compiler, CUDA capture, the AOT cache and its loader.

A model runner asks `build_decode_graphs` for its graphs. The package itself imports nothing heavy; its names
load when first asked for.
"""

from __future__ import annotations

from vx.class_path import lazy_names

_LAZY = {
    "DecodeGraphs": "vx.gpu.graphs.decode_graphs",
    "build_decode_graphs": "vx.gpu.graphs.build",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_names(__name__, _LAZY)
