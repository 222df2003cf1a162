"""Small Triton kernels that expose one device function of vx's kernels for a test to check on its own.

Importing this module imports triton: do it only in a process that has decided TRITON_INTERPRET (the triton tests'
interpreter worker), never in the pytest process.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vx.gpu.attention.triton_kernels import fp8_e4m3_to_f32


@triton.jit
def _decode_fp8_kernel(codes_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, fp8_e4m3_to_f32(tl.load(codes_ptr + offs)))


def decode_fp8(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 float8-e4m3fn codes (a power-of-two count), as the attention kernel decodes them."""
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    _decode_fp8_kernel[(1,)](codes, out, N=codes.numel())
    return out
