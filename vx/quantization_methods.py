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
    # Hugging Face quantized checkpoints, named by their quantization_config.quant_method.
    "awq": "vx.models.layers.quantization.awq:AWQConfig",
    "gptq": "vx.models.layers.quantization.gptq:GPTQConfig",
    "fp8": "vx.models.layers.quantization.fp8:Fp8Config",
    # A float checkpoint quantized at load.
    "int8": "vx.models.layers.quantization.weight_only:Int8Config",
    "int4": "vx.models.layers.quantization.weight_only:Int4Config",
    # GGUF files, their tensors as they are.
    "gguf": "vx.models.layers.quantization.gguf:GGUFConfig",
})
"""Method name -> "module:class" of its `QuantizationConfig`."""

QUANTIZATION_NAMES: tuple[str, ...] = tuple(METHOD_CLASSES)
"""Every value `quantization=` accepts besides None (None: whatever the checkpoint says, else none)."""

KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8_e4m3", "int8")
"""Every value `kv_cache_dtype=` accepts ("auto": the model dtype; the formats are in vx.gpu.attention.kv_format)."""
