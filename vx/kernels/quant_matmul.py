"""Weight-only int4/int8 matmuls in C (`csrc/quant_matmul.c`): the layout the kernel reads, packing into it, the call.

The kernel computes y = x @ W^T with float32 activations and W[n, k] = q[n, k] * scale[n, g] + zero[n, g] for
the group g = k // group_size, dequantizing in registers. Output features are packed in panels of `panel`
features (two vectors of the build's width), each panel k-major, so the arithmetic runs along n; see the C file.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from vx.kernels.build import load_library
from vx.kernels.threads import threads_for

_SOURCE = Path(__file__).with_name("csrc") / "quant_matmul.c"
# No -ffast-math: the kernel needs none of it, only the contraction of a * b + c into FMAs (gnu11 allows it).
_CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-std=gnu11")
# One thread's time per weight, in ns: a fixed part (reading and dequantizing it) and one per row of x. Fitted to
# `python -m benchmarks.quant_matmul --threads 1 --batches 1,2,4,8` on the default model's shapes (AVX-512 EPYC).
_NS_PER_WEIGHT, _NS_PER_WEIGHT_ROW = 0.045, 0.03


def serial_us(m: int, n: int, k: int) -> float:
    """About how long one thread takes for x [m, k] @ W^T [k, n], in µs."""
    return n * k * (_NS_PER_WEIGHT + _NS_PER_WEIGHT_ROW * m) * 1e-3


@dataclass(frozen=True)
class PackedQuantWeight:
    """A weight in the kernel's layout: `q` (uint8 nibble pairs or int8) and `sz` (scales and zeros: float16 when
    all of them are exactly float16 values, else float32)."""

    q: torch.Tensor
    sz: torch.Tensor
    out_features: int
    in_features: int
    group_size: int
    bits: int

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.sz.nbytes


class QuantMatmulKernel:
    """The loaded library: `pack` a weight once, then `matmul` float32 activations with it."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fns = {4: lib.vx_q4_matmul_f32, 8: lib.vx_q8_matmul_f32}
        for fn in self._fns.values():
            fn.argtypes = [p, i64, i64, p, p, ctypes.c_int, i64, i64, p, ctypes.c_int]
            fn.restype = ctypes.c_int
        self.panel: int = lib.vx_quant_panel()

    def pack(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
             bits: int) -> PackedQuantWeight:
        """q [N, K] integers (0..15 for bits=4, -128..127 for bits=8); scale, zero [N, K / group_size]."""
        n, k = q.shape
        if bits not in self._fns or k % group_size or scale.shape != (n, k // group_size) or zero.shape != scale.shape:
            raise ValueError(f"pack: {bits}-bit q {tuple(q.shape)}, scale {tuple(scale.shape)}, zero "
                             f"{tuple(zero.shape)}, groups of {group_size}.")
        p, pad = self.panel, -n % self.panel
        panels = (n + pad) // p
        # Padded features have zero weights (q 0, scale 0, zero 0); the kernel never writes their outputs.
        q = torch.nn.functional.pad(q.to(torch.uint8 if bits == 4 else torch.int8), (0, 0, 0, pad))
        q = q.view(panels, p, k).transpose(1, 2)  # [panel][k][p]
        if bits == 4:
            half = p // 2
            q = q[..., :half] | (q[..., half:] << 4)
        groups = k // group_size
        sz = torch.stack([torch.nn.functional.pad(t.float(), (0, 0, 0, pad)).view(panels, p, groups).transpose(1, 2)
                          for t in (scale, zero)], dim=2)  # [panel][group][scale | zero][p]
        # Half the bytes of scales and zeros where that changes no value (GGUF's Q4_0, Q4_1 and Q8_0 store float16
        # ones): at 4 bits they are a third of what a matmul reads in float32.
        half = sz.to(torch.float16)
        if torch.equal(half.float(), sz):
            sz = half
        return PackedQuantWeight(q.contiguous(), sz.contiguous(), n, k, group_size, bits)

    def matmul(self, x: torch.Tensor, w: PackedQuantWeight) -> torch.Tensor:
        """x [M, K] float32 @ W^T -> [M, N] float32."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != w.in_features:
            raise ValueError(f"matmul: x {x.dtype} {tuple(x.shape)} for a weight of {w.in_features} inputs "
                             "(x must be float32 [M, K]).")
        x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, w.out_features, dtype=torch.float32)
        threads = threads_for(serial_us(m, w.out_features, w.in_features))
        rc = self._fns[w.bits](x.data_ptr(), m, w.in_features, w.q.data_ptr(), w.sz.data_ptr(),
                               int(w.sz.dtype == torch.float16), w.out_features, w.group_size, y.data_ptr(), threads)
        if rc != 0:
            raise ValueError(f"quant_matmul rejected x {tuple(x.shape)} with a {w.bits}-bit weight "
                             f"{w.out_features}x{w.in_features}, groups of {w.group_size}.")
        return y


@functools.cache
def load_quant_matmul_kernel(vector_bytes: int | None = None) -> QuantMatmulKernel | None:
    """The kernel for this CPU, built if needed; None when kernels are off or cannot be built here.

    `vector_bytes` builds another vector width than the CPU's widest (16, 32, 64): the tests run the AVX-512
    layout's code on an AVX2 machine this way (GCC splits the wide vectors).
    """
    flags = _CFLAGS if vector_bytes is None else (*_CFLAGS, f"-DVX_VEC_BYTES={vector_bytes}")
    lib = load_library(_SOURCE, flags, ("-lm",), "CPU quantized matmul kernel")
    return None if lib is None else QuantMatmulKernel(lib)
