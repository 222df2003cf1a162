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


def int8_activation_bound(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                          bits: int) -> torch.Tensor:
    """How far a product with x rounded to int8 per (row, group) may be from the exact x @ W^T, per [M, N].

    Rounding x[m, k] to d * round(x / d), d = max |x[m, group]| / 127, errs by at most d / 2 (plus a few float32
    roundings of d and 1 / d: the 1e-4 margin), so y errs by at most sum_k |w[n, k]| d[m, g(k)] / 2. The integer
    dot products are exact; each group's float epilogue (dx * (s * dot + z * sum)) and the sum over groups round
    at most (groups + 8) times, relative to the products' magnitudes with the codes as the kernel holds them
    (8-bit ones biased by 128, the zero by -128 s).
    """
    m, k = x.shape
    n = q.shape[0]
    x64 = x.double()
    step = x64.abs().view(m, k // group, group).amax(-1) / 127
    half_step = (step / 2 * (1 + 1e-4)).repeat_interleave(group, dim=1)  # [M, K]
    w = dequantize(q, scale, zero, group)
    offset = 128 if bits == 8 else 0
    s = scale.double().repeat_interleave(group, dim=1)
    z = zero.double().repeat_interleave(group, dim=1)
    magnitude = s * (q.double().abs() + 2 * offset) + z.abs()  # [N, K]
    u = UNIT_ROUNDOFF[torch.float32]
    return half_step @ w.abs().T + (k // group + 8) * u * ((x64.abs() + half_step) @ magnitude.T)


def assert_within_int8_rounding(y: torch.Tensor, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                                zero: torch.Tensor, group: int, bits: int) -> None:
    """y (in x's dtype, any leading dimensions) equals x @ W^T up to `int8_activation_bound` (x rounded to int8 per
    group, the int8-activation path) and the result's rounding to x's dtype."""
    x2 = x.reshape(-1, q.shape[1])
    exact = x2.double() @ dequantize(q, scale, zero, group).T
    u_out = UNIT_ROUNDOFF[x.dtype] if x.dtype != torch.float32 else 0.0
    bound = int8_activation_bound(x2.float(), q, scale, zero, group, bits) * (1 + u_out) + u_out * exact.abs()
    err = (y.double().reshape(exact.shape) - exact).abs()
    worst = (err - bound).argmax().item()
    assert (err <= bound).all(), (f"error {err.flatten()[worst].item():.3e} above its bound "
                                  f"{bound.flatten()[worst].item():.3e} at (row, output) {divmod(worst, q.shape[0])}")
