"""Quantization methods for the layers: the base classes, the float path, and `get_quantization_config`, which
imports a method's module only when a model uses it (the methods are rows of `registry`).

The package itself imports nothing heavy: the application process reads `registry` (which methods exist, how they
split over ranks) without torch; the names below load when first asked for.
"""

from __future__ import annotations

from vx.class_path import lazy_names

_LAZY = {
    "EmbeddingMethodBase": "vx.models.layers.quantization.base_config",
    "LinearMethodBase": "vx.models.layers.quantization.base_config",
    "QuantizationConfig": "vx.models.layers.quantization.base_config",
    "UnquantizedLinearMethod": "vx.models.layers.quantization.unquantized",
    "get_quantization_config": "vx.models.layers.quantization.loading",
    "get_quantization_config_class": "vx.models.layers.quantization.loading",
    "process_weights_after_loading": "vx.models.layers.quantization.loading",
    "set_weight_attrs": "vx.models.layers.quantization.base_config",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_names(__name__, _LAZY)
