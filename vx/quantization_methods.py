"""The quantization methods by name: what `quantization=` and a checkpoint's `quantization_config.quant_method`
may name, and where each method's `QuantizationConfig` lives.

The one list of method names. It imports nothing, so the config validates against it in the application's
process (which never imports torch); `vx.models.layers.quantization` imports a method's module only when a model
uses it.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

METHOD_CLASSES: Mapping[str, str] = MappingProxyType({
})
"""Method name -> "module:class" of its `QuantizationConfig`."""

QUANTIZATION_NAMES: tuple[str, ...] = tuple(METHOD_CLASSES)
"""Every value `quantization=` accepts besides None (None: whatever the checkpoint says, else none)."""

KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8_e4m3", "int8")
"""Every value `kv_cache_dtype=` accepts ("auto": the model dtype; the formats are in vx.gpu.attention.kv_format)."""
