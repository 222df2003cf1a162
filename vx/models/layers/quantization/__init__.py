"""Quantization methods for the layers: the base classes, the float path, and `get_quantization_config`, which
imports a method's module only when a model uses it (the names live in vx.quantization_methods)."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from vx.models.layers.quantization.base_config import (EmbeddingMethodBase, LinearMethodBase, QuantizationConfig,
                                                       set_weight_attrs)
from vx.models.layers.quantization.unquantized import UnquantizedLinearMethod
from vx.quantization_methods import METHOD_CLASSES

__all__ = ["EmbeddingMethodBase", "LinearMethodBase", "QuantizationConfig", "UnquantizedLinearMethod",
           "get_quantization_config", "get_quantization_config_class", "process_weights_after_loading",
           "set_weight_attrs"]


def get_quantization_config_class(name: str) -> type[QuantizationConfig]:
    """The `QuantizationConfig` class of method `name`; `ValueError` naming the known ones otherwise."""
    if name not in METHOD_CLASSES:
        raise ValueError(f"Quantization method {name!r} is not supported; supported: "
                         f"{', '.join(METHOD_CLASSES) or 'none'}.")
    module_name, class_name = METHOD_CLASSES[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def get_quantization_config(name: str | None, checkpoint_config: dict[str, Any] | None) -> QuantizationConfig | None:
    """The quantization of a model: method `name` (resolved by the engine config), read from the checkpoint's
    `quantization_config` when it has one; None for a float model.

    The two must agree: the engine loads what the config says even when the config was made elsewhere than by
    `EngineArgs` (which resolves `name` from the checkpoint), and a quantized checkpoint read as float weights, or
    as another method's, would be a silently wrong model. A disagreement is a `ValueError` naming both."""
    cls = get_quantization_config_class(name) if name is not None else None
    checkpoint_method = str(checkpoint_config.get("quant_method", "")).lower() if checkpoint_config else None
    if checkpoint_method is not None and checkpoint_method != name:
        loads = ", ".join(METHOD_CLASSES) or "none"
        raise ValueError(f"The checkpoint is quantized with quant_method={checkpoint_method!r}, but the engine was "
                         f"configured to load it with quantization={name!r} (vx's methods: {loads}; leave quantization "
                         f"unset to load a checkpoint as it says).")
    if cls is None:
        return None
    return cls.from_config(dict(checkpoint_config or {}))


def process_weights_after_loading(model: torch.nn.Module) -> None:
    """Let each layer's quantization method ready what was loaded (repack for its kernel), once per method: a tied
    LM head shares its embedding's method and is readied through the embedding."""
    seen: set[int] = set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None or id(method) in seen:
            continue
        seen.add(id(method))
        method.process_weights_after_loading(module)
