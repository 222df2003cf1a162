"""Hugging Face architecture name -> vx model class, imported when first asked for (`vx.model_architectures`
holds the list)."""

from __future__ import annotations

import importlib

from torch import nn

from vx.model_architectures import MODEL_CLASSES, unsupported_architecture


def supported_architectures() -> list[str]:
    """Architecture names (as in config.json `architectures`) that vx can run."""
    return sorted(MODEL_CLASSES)


def resolve_model_class(arch: str) -> type[nn.Module]:
    """The class serving `arch`; ValueError listing the supported ones if there is none."""
    reason = unsupported_architecture(arch)
    if reason is not None:
        raise ValueError(reason)
    module, _, name = MODEL_CLASSES[arch].partition(":")
    return getattr(importlib.import_module(module), name)
