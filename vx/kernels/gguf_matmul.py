"""Matmuls with GGUF weights read as the file stores them (`csrc/gguf_kquant.c`): no repacking, so a decode step
reads exactly the file's bytes for its weights.

y = x @ W^T for float32 x [M, K] and W [N, K] given as N rows of GGML blocks (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K). x is
rounded to int8 per block of 256 values (the K types) or 32 (Q4_0, Q8_0), as llama.cpp does: each element errs by
at most half a step, max |x[block]| / 254, which is the only error beyond float rounding. Two builds: with VNNI dot
products where the CPU has them, and AVX2 otherwise (or for the tests, on a VNNI machine).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from vx import envs
from vx.kernels.build import load_library
from vx.kernels.threads import threads_for

_SOURCE = Path(__file__).with_name("csrc") / "gguf_kquant.c"
_CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-std=gnu11")
# Build flags that take AVX-512 and VNNI away: the build an AVX2-only CPU gets, run on an AVX-512 machine.
_AVX2_ONLY = ("-mno-avx512f", "-mno-avxvnni")
# One thread's time per stored weight byte, in ns: a fixed part (reading and decoding it) and one per row of x.
# Fitted to `python -m benchmarks.gguf_matmul` at batch 1-16 on one thread (AVX-512 VNNI EPYC).
_NS_PER_BYTE, _NS_PER_BYTE_ROW = 0.08, 0.08


def serial_us(m: int, weight_bytes: int) -> float:
    """About how long one thread takes for x [m, K] times a weight of `weight_bytes` stored bytes, in µs."""
    return weight_bytes * (_NS_PER_BYTE + _NS_PER_BYTE_ROW * m) * 1e-3


class GGUFMatmulKernel:
    """The loaded library: `matmul` float32 activations with raw GGUF rows of a type in `types`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fn = lib.vx_gguf_matmul_f32
        self._fn.argtypes = [p, i64, i64, p, i64, i32, i64, p, i64, i32]
        self._fn.restype = i32
        self._row_bytes = lib.vx_gguf_row_bytes
        self._row_bytes.argtypes = [i32, i64]
        self._row_bytes.restype = i64
        mask = lib.vx_gguf_types()
        self.types: frozenset[int] = frozenset(t for t in range(32) if mask & (1 << t))
        self.vnni = bool(lib.vx_gguf_vnni())

    def serves(self, ggml_type: int) -> bool:
        """Whether `VX_CPU_MATMUL` and this CPU give a weight of `ggml_type` this kernel: `int8`, or `auto` where
        the dot products are VNNI ones (the choice the repacked int8 path makes too)."""
        mode = envs.VX_CPU_MATMUL.get()
        return ggml_type in self.types and (mode == "int8" or (mode == "auto" and self.vnni))

    def matmul(self, x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, threads: int | None = None) -> torch.Tensor:
        """x [M, K] float32 @ W^T -> [M, N] float32, W's N rows the uint8 rows of `blocks` [N, row bytes];
        `threads` overrides the thread count the call's size asks for (tests, benchmarks)."""
        if x.dtype != torch.float32 or x.dim() != 2 or blocks.dtype != torch.uint8 or blocks.dim() != 2:
            raise ValueError(f"gguf matmul: x {x.dtype} {tuple(x.shape)} must be float32 [M, K], blocks "
                             f"{blocks.dtype} {tuple(blocks.shape)} uint8 [N, bytes].")
        m, k = x.shape
        if blocks.shape[1] != self._row_bytes(ggml_type, k):
            raise ValueError(f"gguf matmul: rows of {blocks.shape[1]} bytes are not {k} weights of GGML type "
                             f"{ggml_type} (or the type is not served: {sorted(self.types)}).")
        if blocks.stride(1) != 1:
            blocks = blocks.contiguous()
        x = x.contiguous()
        n = blocks.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        threads = threads or threads_for(serial_us(m, blocks.shape[0] * blocks.shape[1]))
        rc = self._fn(x.data_ptr(), m, k, blocks.data_ptr(), blocks.stride(0), ggml_type, n, y.data_ptr(), n,
                      threads)
        if rc != 0:
            raise ValueError(f"gguf matmul rejected x {tuple(x.shape)} with {n} rows of {blocks.shape[1]} bytes of "
                             f"GGML type {ggml_type}.")
        return y


@functools.cache
def load_gguf_matmul_kernel(vnni: bool = True, wide: bool = True) -> GGUFMatmulKernel | None:
    """The kernel for this CPU, built if needed; None when kernels are off or cannot be built here. For the tests
    and benchmarks: `vnni=False` builds it as for an AVX2-only CPU (no AVX-512, no VNNI), `wide=False` without its
    512-bit Q4_K and Q6_K code (the 256-bit code every other build runs)."""
    flags = _CFLAGS if vnni else (*_CFLAGS, *_AVX2_ONLY)
    if not wide:
        flags = (*flags, "-DVX_GGUF_256")
    lib = load_library(_SOURCE, flags, (), "CPU GGUF matmul kernel")
    return None if lib is None else GGUFMatmulKernel(lib)
