"""Weight-only int4/int8 matmuls in C: the layouts the kernels read, packing into them, the call.

Both compute y = x @ W^T for float32 x and W[n, k] = q[n, k] * scale[n, g] + zero[n, g], g = k // group_size:
- the float path (`csrc/quant_matmul.c`) dequantizes W in registers and multiplies in float32: exact up to float
  rounding. Output features in panels of `panel` (two vectors of the build's width), each panel k-major.
- the int8-activation path (`csrc/quant_matmul_i8.c`) rounds x to int8 per (row, group) and sums integer
  products (VNNI): x's rounding (at most half a step, max |x[group]| / 254, per element) is its only extra
  error. Panels of `i8_panel` features, four consecutive k per 32-bit lane.
Which one a weight gets is chosen once, at `pack`: `VX_CPU_MATMUL` (`auto`: the int8 path where the CPU has VNNI
and the weight fits it, measured faster there at every batch size; see `benchmarks/quant_matmul.py`).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from vx import envs
from vx.kernels.build import Library, load_library
from vx.kernels.threads import threads_for

_SOURCE = Path(__file__).with_name("csrc") / "quant_matmul.c"
_SOURCE_I8 = Path(__file__).with_name("csrc") / "quant_matmul_i8.c"
_SOURCE_AMX = Path(__file__).with_name("csrc") / "quant_matmul_amx.c"
# Build flags that take VNNI away, to run the int8 path's AVX2 fallback (and auto's choice) on a VNNI machine.
_NO_VNNI = ("-mno-avx512vnni", "-mno-avxvnni")
# No -ffast-math: the kernel needs none of it, only the contraction of a * b + c into FMAs (gnu11 allows it).
_CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-std=gnu11")
# One thread's time per weight, in ns: a fixed part (reading and dequantizing it) and one per row of x. Fitted to
# `python -m benchmarks.quant_matmul --threads 1 --batches 1,2,4,8` on the default model's shapes (AVX-512 EPYC).
_NS_PER_WEIGHT, _NS_PER_WEIGHT_ROW = 0.045, 0.03
# The same for the int8-activation path (VNNI), fitted the same way.
_NS_PER_WEIGHT_I8, _NS_PER_WEIGHT_ROW_I8 = 0.035, 0.0075
# From how many rows of x an int8-layout weight takes the AMX path: its tiles hold 32 rows, and below that the
# int8 path was faster on every shape of the default model (`python -m benchmarks.quant_matmul`, AMX Xeon).
AMX_MIN_ROWS = 32


def serial_us(m: int, n: int, k: int, int8_activations: bool = False) -> float:
    """About how long one thread takes for x [m, k] @ W^T [k, n], in µs."""
    if int8_activations:
        return n * k * (_NS_PER_WEIGHT_I8 + _NS_PER_WEIGHT_ROW_I8 * m) * 1e-3
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
    int8_activations: bool = False  # packed for csrc/quant_matmul_i8.c (x rounded to int8), else the float path
    amx: bool = False  # products of many rows may take csrc/quant_matmul_amx.c (bf16 tiles) instead

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.sz.nbytes

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """W[rows] [R, K] in float32, read out of the packed layout: a token embedding tied to this weight (its LM
        head) looks its rows up here instead of keeping a second copy of the table. Exactly q * scale + zero."""
        p = self.sz.shape[-1]  # features per panel, whichever layout
        panel, lane = rows // p, rows % p
        k = self.in_features
        if self.int8_activations:  # [panel][k/4][p][4] bytes, or at 4 bits [panel][k/8][p][4] nibble pairs
            quads = self.q[panel, :, lane, :]
            if self.bits == 4:
                q = torch.stack((quads & 15, quads >> 4), dim=2).reshape(-1, k)
            else:
                q = quads.reshape(-1, k).to(torch.int16) - 128
        elif self.bits == 4:  # [panel][k][p/2]: the panel's first half of features in the low nibbles
            half = p // 2
            nibbles = self.q[panel, :, lane % half]
            q = torch.where((lane < half)[:, None], nibbles & 15, nibbles >> 4)
        else:  # [panel][k][p]
            q = self.q[panel, :, lane]
        scale_zero = self.sz[panel, :, :, lane].float()  # [R, groups, scale | zero]
        groups = q.reshape(q.shape[0], -1, self.group_size).float()
        return (groups * scale_zero[..., 0, None] + scale_zero[..., 1, None]).reshape(-1, k)


class QuantMatmulKernel:
    """The loaded libraries: `pack` a weight once, then `matmul` float32 activations with it."""

    def __init__(self, lib: ctypes.CDLL, lib_i8: ctypes.CDLL | None = None, lib_amx: ctypes.CDLL | None = None) -> None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fns = {4: lib.vx_q4_matmul_f32, 8: lib.vx_q8_matmul_f32}
        for fn in self._fns.values():
            fn.argtypes = [p, i64, i64, p, p, i32, i64, i64, p, i32]
            fn.restype = i32
        self.panel: int = lib.vx_quant_panel()
        # The int8-activation path: the weight bit widths it serves here (none without its library) and whether
        # its dot products are VNNI ones (what `auto` asks for: the AVX2 fallback is not measured faster).
        self.i8_bits: frozenset[int] = frozenset()
        self.i8_vnni = False
        self.i8_panel = 0
        if lib_i8 is not None:
            self._fn_i8 = lib_i8.vx_i8_matmul_f32
            self._fn_i8.argtypes = [p, i64, i64, p, i32, p, i32, i64, i64, p, i32]
            self._fn_i8.restype = i32
            support = lib_i8.vx_i8_support()
            self.i8_bits = frozenset(b for b in (4, 8) if support & (1 << b))
            self.i8_vnni = bool(lib_i8.vx_i8_vnni())
            self.i8_panel = lib_i8.vx_i8_panel()
        # The AMX path for int8-layout weights with many rows (csrc/quant_matmul_amx.c), where the CPU and the OS
        # grant AMX tiles; it reads the 16-feature layout only.
        self._fn_amx = None
        if lib_amx is not None and lib_amx.vx_amx_support() and self.i8_panel == 16 and lib_amx.vx_amx_ready():
            self._fn_amx = lib_amx.vx_amx_matmul_f32
            self._fn_amx.argtypes = [p, i64, i64, p, i32, p, i32, i64, i64, p, i32]
            self._fn_amx.restype = i32

    @property
    def has_amx(self) -> bool:
        """Whether this CPU, its OS and the build give the AMX path."""
        return self._fn_amx is not None

    def amx_for(self, int8_activations: bool, in_features: int) -> bool:
        """Whether `pack` lets a weight's many-row products take the AMX path: `VX_CPU_MATMUL=auto`, a CPU and OS
        that grant AMX tiles, the int8 layout of 16-feature panels, whole 32-k tiles."""
        return (self._fn_amx is not None and int8_activations and envs.VX_CPU_MATMUL.get() == "auto"
                and in_features % 32 == 0)

    @staticmethod
    def uses_amx(m: int, w: PackedQuantWeight) -> bool:
        """Whether x of `m` rows times `w` takes the AMX path: rows enough to repay dequantizing the weight."""
        return w.amx and m >= AMX_MIN_ROWS

    def int8_activations_for(self, bits: int, group_size: int) -> bool:
        """Whether `pack` gives such a weight the int8-activation path, by `VX_CPU_MATMUL` and what this CPU has."""
        mode = envs.VX_CPU_MATMUL.get()
        fits = bits in self.i8_bits and group_size % 8 == 0
        return fits and (mode == "int8" or (mode == "auto" and self.i8_vnni))

    def pack(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
             bits: int) -> PackedQuantWeight:
        """q [N, K] integers (0..15 for bits=4, -128..127 for bits=8); scale, zero [N, K / group_size]."""
        n, k = q.shape
        if bits not in self._fns or k % group_size or scale.shape != (n, k // group_size) or zero.shape != scale.shape:
            raise ValueError(f"pack: {bits}-bit q {tuple(q.shape)}, scale {tuple(scale.shape)}, zero "
                             f"{tuple(zero.shape)}, groups of {group_size}.")
        int8_act = self.int8_activations_for(bits, group_size)
        p = self.i8_panel if int8_act else self.panel
        pad = -n % p
        panels = (n + pad) // p
        # Padded features have zero weights (q 0, scale 0, zero 0); the kernel never writes their outputs.
        if int8_act:
            # Unsigned bytes (4-bit codes, or 8-bit ones + 128), four consecutive k per lane: [panel][k/4][p][4].
            q = q.to(torch.int16) + (128 if bits == 8 else 0)
            q = torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, pad)).view(panels, p, k // 4, 4).transpose(1, 2)
            if bits == 4:  # quads 2t and 2t + 1 in the low and high nibbles of one byte: [panel][k/8][p][4]
                q = q[:, 0::2] | (q[:, 1::2] << 4)
        else:
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
        return PackedQuantWeight(q.contiguous(), sz.contiguous(), n, k, group_size, bits, int8_act,
                                 self.amx_for(int8_act, k))

    def matmul(self, x: torch.Tensor, w: PackedQuantWeight, amx: bool | None = None) -> torch.Tensor:
        """x [M, K] float32 @ W^T -> [M, N] float32. `amx` True / False forces the AMX path on or off for a weight
        packed for it (benchmarks measure both at every M); None leaves it to `uses_amx`."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != w.in_features:
            raise ValueError(f"matmul: x {x.dtype} {tuple(x.shape)} for a weight of {w.in_features} inputs "
                             "(x must be float32 [M, K]).")
        x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, w.out_features, dtype=torch.float32)
        half = int(w.sz.dtype == torch.float16)
        if self._fn_amx is not None and w.amx and (self.uses_amx(m, w) if amx is None else amx):
            rc = self._fn_amx(x.data_ptr(), m, w.in_features, w.q.data_ptr(), w.bits, w.sz.data_ptr(), half,
                              w.out_features, w.group_size, y.data_ptr(), torch.get_num_threads())
        elif w.int8_activations:
            threads = threads_for(serial_us(m, w.out_features, w.in_features, int8_activations=True))
            rc = self._fn_i8(x.data_ptr(), m, w.in_features, w.q.data_ptr(), w.bits, w.sz.data_ptr(), half,
                             w.out_features, w.group_size, y.data_ptr(), threads)
        else:
            threads = threads_for(serial_us(m, w.out_features, w.in_features))
            rc = self._fns[w.bits](x.data_ptr(), m, w.in_features, w.q.data_ptr(), w.sz.data_ptr(), half,
                                   w.out_features, w.group_size, y.data_ptr(), threads)
        if rc != 0:
            raise ValueError(f"quant_matmul rejected x {tuple(x.shape)} with a {w.bits}-bit weight "
                             f"{w.out_features}x{w.in_features}, groups of {w.group_size}.")
        return y


def default_libraries() -> tuple[Library, ...]:
    """The libraries `load_quant_matmul_kernel()` builds (a worker builds them before its model loads)."""
    return (Library(_SOURCE, _CFLAGS, ("-lm",), "CPU quantized matmul kernel"),
            Library(_SOURCE_I8, _CFLAGS, (), "CPU int8-activation matmul kernel"),
            Library(_SOURCE_AMX, _CFLAGS, (), "CPU AMX matmul kernel"))


@functools.cache
def load_quant_matmul_kernel(vector_bytes: int | None = None, vnni: bool = True) -> QuantMatmulKernel | None:
    """The kernel for this CPU, built if needed; None when kernels are off or cannot be built here.

    `vector_bytes` builds another vector width than the CPU's widest (16, 32, 64): the tests run the AVX-512
    layout's code on an AVX2 machine this way (GCC splits the wide vectors). `vnni=False` builds the int8 path
    as for a CPU without VNNI (its AVX2 fallback, or none), for the tests.
    """
    flags = _CFLAGS if vector_bytes is None else (*_CFLAGS, f"-DVX_VEC_BYTES={vector_bytes}")
    lib = load_library(_SOURCE, flags, ("-lm",), "CPU quantized matmul kernel")
    if lib is None:
        return None
    # Without the int8 path's library (a failed build) every weight takes the float path.
    lib_i8 = load_library(_SOURCE_I8, flags if vnni else (*flags, *_NO_VNNI), (), "CPU int8-activation matmul kernel")
    lib_amx = None
    if vector_bytes is None and vnni:
        lib_amx = load_library(_SOURCE_AMX, _CFLAGS, (), "CPU AMX matmul kernel")
    return QuantMatmulKernel(lib, lib_i8, lib_amx)
