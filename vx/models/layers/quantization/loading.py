"""A model's quantization at load: its method's `QuantizationConfig`, read from the checkpoint and checked against
what the engine config says, and the methods' readying of the weights once they are in."""

from __future__ import annotations

from typing import Any

import torch

from vx.class_path import load_name
from vx.models.layers.quantization.base_config import QuantizationConfig
from vx.models.layers.quantization.registry import QUANTIZATION_NAMES, quantization_method


def get_quantization_config_class(name: str) -> type[QuantizationConfig]:
    """The `QuantizationConfig` class of method `name`; `ValueError` naming the known ones otherwise."""
    return load_name(quantization_method(name).config_class)


def get_quantization_config(name: str | None, checkpoint_config: dict[str, Any] | None) -> QuantizationConfig | None:
    """The quantization of a model: method `name` (resolved by the engine config), read from the checkpoint's
    `quantization_config` when it has one; None for a float model.

    The two must agree: the engine loads what the config says even when the config was made elsewhere than by
    `EngineArgs` (which resolves `name` from the checkpoint), and a quantized checkpoint read as float weights, or
    as another method's, would be a silently wrong model. A disagreement is a `ValueError` naming both."""
    cls = get_quantization_config_class(name) if name is not None else None
    checkpoint_method = str(checkpoint_config.get("quant_method", "")).lower() if checkpoint_config else None
    if checkpoint_method is not None and checkpoint_method != name:
        loads = ", ".join(QUANTIZATION_NAMES) or "none"
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
