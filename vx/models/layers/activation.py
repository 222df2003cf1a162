"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for the fused [gate | up] projection output of width 2d."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Split the last dim in half and gate the second half with silu of the first."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class GeluAndMul(nn.Module):
    """gelu(x[..., :d]) * x[..., d:] (tanh approximation where the model's `hidden_activation` asks for it)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Split the last dim in half and gate the second half with gelu of the first."""
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]
