"""Random weight-only quantized layers and the rounding bound a kernel's product must meet against float64.

A product y = x @ W^T computed in float32 (any order, FMAs or not) differs from the exact one by at most
(K + 2) * u32 * (|x| @ |W|^T) (the classic bound gamma_K for a K-term dot product, plus the rounding of
q * s + z into a float weight); a path that rounds each dequantized weight to a narrower dtype adds that dtype's
unit roundoff times the same sum, and rounding the result to the activation dtype adds its unit roundoff times
|y|. A wrong weight, group or row is off by the size of the weights themselves, orders of magnitude above this.
"""

from __future__ import annotations

import torch

# Unit roundoff (half an ulp at 1) of each dtype: round-to-nearest errs by at most this, relatively.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def random_groupwise(n: int, k: int, group: int, bits: int, seed: int,
                     dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, K] (uint8 0..15 for 4 bits, int8 for 8), scale and zero [N, K / group] in `dtype`, seeded."""
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    else:
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, k // group, generator=g) * 0.1 + 0.01).to(dtype)
    zero = (torch.randn(n, k // group, generator=g) * 0.1).to(dtype)
    return q, scale, zero


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> torch.Tensor:
    """The float64 weight [N, K] the integers stand for: q * scale + zero per group (scales as given)."""
    n, k = q.shape
    w = q.double().view(n, k // group, group) * scale.double()[..., None] + zero.double()[..., None]
    return w.view(n, k)


def assert_within_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                           weight_error: torch.Tensor | None = None) -> None:
    """y (in x's dtype) equals x @ w^T up to float32 accumulation, the result's rounding to x's dtype, and
    `weight_error` [N, K]: a bound on how far the weights the path multiplies by may be from `w` (0 by default:
    a path that dequantizes into float32 rounds each weight once, inside the accumulation bound)."""
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0])
    x64 = x.double().reshape(-1, w.shape[1])
    e = torch.zeros_like(w) if weight_error is None else weight_error.double()
    exact = x64 @ w.T
    gamma = (w.shape[1] + 2) * UNIT_ROUNDOFF[torch.float32]
    u_out = UNIT_ROUNDOFF[x.dtype] if x.dtype != torch.float32 else 0.0
    bound = (gamma * (x64.abs() @ (w.abs() + e).T) + x64.abs() @ e.T) * (1 + u_out) + u_out * exact.abs()
    err = (y.double().reshape(exact.shape) - exact).abs()
    worst = (err - bound).argmax().item()
    assert (err <= bound).all(), (f"error {err.flatten()[worst].item():.3e} above its bound "
                                  f"{bound.flatten()[worst].item():.3e} at (row, output) {divmod(worst, w.shape[0])}")
