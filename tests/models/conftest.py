"""Session fixtures: tiny random HF models of every family, saved as safetensors, plus loaded vx models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

from tests.support.tiny_models import make_tiny_model


@dataclass
class TinyModel:
    """A saved tiny model: its directory, the HF model holding the same weights, and its config."""

    family: str
    path: str
    hf_model: Any

    @property
    def config(self) -> Any:
        return self.hf_model.config


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], TinyModel]:
    """`tiny_model(family)` -> TinyModel, built once per session per family."""
    cache: dict[str, TinyModel] = {}

    def get(family: str) -> TinyModel:
        if family not in cache:
            path, hf = make_tiny_model(family, tmp_path_factory.mktemp(f"tiny-{family}"), return_hf=True)
            cache[family] = TinyModel(family, path, hf)
        return cache[family]

    return get


@pytest.fixture(scope="session")
def load_vx_model() -> Callable[..., torch.nn.Module]:
    """`load_vx_model(tiny, dtype=float32)` -> a vx model loaded from the tiny model's directory (uncached:
    each caller binds its own KV cache)."""
    from vx.models import DefaultModelLoader

    def load(tiny: TinyModel, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        return DefaultModelLoader().load_model(tiny.path, tiny.config, dtype, torch.device("cpu"))

    return load
