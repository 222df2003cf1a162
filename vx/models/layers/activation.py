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
