"""Matmuls with GGUF weights read as the file stores them (`csrc/gguf_kquant.c`): no repacking, so a decode step
reads exactly the file's bytes for its weights.

y = x @ W^T for float32 x [M, K] and W [N, K] given as N rows of GGML blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_XS,
Q4_K, Q5_K, Q6_K). x is rounded to int8 per block of 256 values (Q4_K, Q5_K, Q6_K) or 32 (the types with a float
scale per 32 weights), as llama.cpp does: each element errs by at most half a step, max |x[block]| / 254, which is
the only error beyond float rounding. Two builds: with VNNI dot
products where the CPU has them, and AVX2 otherwise (or for the tests, on a VNNI machine).

Q4_K and Q6_K products of several rows of x (from `ROWS_FROM`: a decode step of a few requests on, prefill too)
take `matmul_rows` where the CPU has AVX-512 VNNI (`csrc/gguf_rows.c`): each block of 16 weight rows is decoded
once per call into registers' lanes (one weight row per int32 lane, as the repacked int8 kernel lays them out) and
every row of x multiplies it there, one instruction per 64 products. x is rounded as the as-stored kernel rounds
it (per block of 256).

Products of many rows of the other types, or on CPUs without that kernel, take another way (`matmul_many_rows`):
chunks of the weight are decoded into the panel layout of the repacked int8-activation kernel
(`csrc/gguf_panels.c`), where each panel serves every row of x, and multiplied there (or on AMX tiles where that
kernel has them, which a bf16 model's Q4_K and Q6_K products of many rows take too); the weight kept stays the
file's blocks. x is then rounded per group of the weight (32, or 16 for Q6_K), as that kernel rounds it. An
AVX2-only CPU's int8 kernel takes 4-bit panels only (Q4_0, Q4_1, Q4_K): the other types stay on the as-stored
kernel there at every M.

Within each way a row's product depends on that row alone (not on M, the other rows or the threads); the ways
differ in float rounding (and the panels in x's rounding), so `ROWS_FROM` is one more than a power of two: the
padded batch of a compiled CPU decode graph (a power of two) takes the way its unpadded eager step takes.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from vx import envs
from vx.kernels.build import Library, load_library
from vx.kernels import quant_matmul
from vx.kernels.quant_matmul import AMX_MIN_ROWS, PackedQuantWeight, QuantMatmulKernel, load_quant_matmul_kernel
from vx.kernels.threads import threads_for

_SOURCE = Path(__file__).with_name("csrc") / "gguf_kquant.c"
# Bytes of panels decoded per chunk of a many-row product: each chunk costs the int8 kernel one more rounding of x,
# so few and large, but bounded, so that a call's scratch stays small beside the weight.
_PANEL_CHUNK_BYTES = 16 << 20
# From how many rows of x a product takes the decoded panels instead of the as-stored kernel, per GGML type (Q6_K's
# decode costs more): the crossings measured with `python -m benchmarks.gguf_matmul --shapes 1.7b_gate,1.7b_down
# --batches 1,4,16,32,64,512 --candidates stored,panels` (AVX-512 VNNI EPYC, docs/performance.md): Q4_K between 16
# and 32 rows on one or two threads; Q6_K about 64 on one thread, above 64 on two. The other types are not
# measured and take Q4_K's.
MANY_ROWS, MANY_ROWS_Q6_K = 32, 128
# From how many rows of x a Q4_K or Q6_K product takes `matmul_rows` where it is built: `python -m
# benchmarks.gguf_matmul --shapes 1.7b_gate,1.7b_down --batches 1,2,3,4,5,8 --threads 1` (AVX-512 VNNI EPYC,
# docs/performance.md): as fast as the as-stored kernel at 2-4 rows for Q4_K, faster from 3 for Q6_K, slower at 1.
# One more than a power of two (see the module).
ROWS_FROM = 3
_Q6_K = 14
_CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-std=gnu11")
# Build flags that take AVX-512 and VNNI away: the build an AVX2-only CPU gets, run on an AVX-512 machine.
_AVX2_ONLY = ("-mno-avx512f", "-mno-avxvnni")
_WHAT = "CPU GGUF matmul kernel"
_PANELS = Library(_SOURCE.with_name("gguf_panels.c"), _CFLAGS, (), "CPU GGUF panel decoder")
_ROWS = Library(_SOURCE.with_name("gguf_rows.c"), _CFLAGS, (), "CPU GGUF several-rows kernel")
# One thread's time per stored weight byte, in ns: a fixed part (reading and decoding it) and one per row of x.
# Fitted to `python -m benchmarks.gguf_matmul --threads 1 --batches 1,4,16` (AVX-512 VNNI EPYC, 1.7B shapes).
_NS_PER_BYTE, _NS_PER_BYTE_ROW = 0.05, 0.02


def many_rows(ggml_type: int) -> int:
    """From how many rows of x a product with a weight of `ggml_type` takes the decoded panels."""
    return MANY_ROWS_Q6_K if ggml_type == _Q6_K else MANY_ROWS


def serial_us(m: int, weight_bytes: int) -> float:
    """About how long one thread takes for x [m, K] times a weight of `weight_bytes` stored bytes, in µs."""
    return weight_bytes * (_NS_PER_BYTE + _NS_PER_BYTE_ROW * m) * 1e-3


class GGUFMatmulKernel:
    """The loaded library: `matmul` float32 activations with raw GGUF rows of a type in `types`."""

    def __init__(self, lib: ctypes.CDLL, lib_panels: ctypes.CDLL | None = None,
                 repacked: QuantMatmulKernel | None = None, lib_rows: ctypes.CDLL | None = None) -> None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fn = lib.vx_gguf_matmul_f32
        self._fn.argtypes = [p, i64, i64, p, i64, i32, i64, p, i64, i32]
        self._fn.restype = i32
        # The several-rows kernel's types here (none without its library or off AVX-512 VNNI).
        self.rows_types: frozenset[int] = frozenset()
        if lib_rows is not None:
            self._fn_rows = lib_rows.vx_gguf_rows_matmul_f32
            self._fn_rows.argtypes = [p, i64, i64, p, i64, i32, i64, p, i64, i32]
            self._fn_rows.restype = i32
            mask = lib_rows.vx_gguf_rows_types()
            self.rows_types = frozenset(t for t in range(32) if mask & (1 << t))
        row_bytes = lib.vx_gguf_row_bytes
        row_bytes.argtypes = [i32, i64]
        row_bytes.restype = i64
        # Asked on every call with the same few (type, K): a dict look-up, not a ctypes call.
        self._row_bytes = functools.lru_cache(maxsize=None)(row_bytes)
        mask = lib.vx_gguf_types()
        self.types: frozenset[int] = frozenset(t for t in range(32) if mask & (1 << t))
        self.vnni = bool(lib.vx_gguf_vnni())
        self._panels = None
        self._repacked = repacked
        if lib_panels is not None:
            self._panels = lib_panels.vx_gguf_to_i8_panels
            self._panels.argtypes = [p, i64, i32, i64, i64, i64, p, p, i32]
            self._panels.restype = i32
            self._panel_format = lib_panels.vx_gguf_panel_format

    def panel_format(self, ggml_type: int) -> tuple[int, int] | None:
        """(bits, group size) of the int8 kernel's layout that `matmul_many_rows` decodes `ggml_type` into."""
        if self._panels is None:
            return None
        code = self._panel_format(ggml_type)
        return None if code < 0 else divmod(code, 1000)

    def many_rows_serves(self, ggml_type: int, repacked: QuantMatmulKernel | None) -> bool:
        """Whether `matmul_many_rows` can take weights of `ggml_type` with that int8 kernel here."""
        fmt = self.panel_format(ggml_type)
        return fmt is not None and repacked is not None and fmt[0] in repacked.i8_bits

    def matmul_many_rows(self, x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, repacked: QuantMatmulKernel,
                         amx: bool = False) -> torch.Tensor:
        """x [M, K] float32 @ W^T -> [M, N] float32 through the int8 kernel's panels, decoded chunk by chunk (see
        the module); `amx` lets that kernel take its AMX path (x then rounded to bf16). Only where
        `many_rows_serves`."""
        bits, group = self.panel_format(ggml_type)
        x, blocks = self._checked(x, blocks, ggml_type)
        m, k = x.shape
        n = blocks.shape[0]
        lanes = repacked.i8_panel
        panel_bytes = k * lanes * bits // 8 + 2 * (k // group) * lanes * 4
        rows = max(1, _PANEL_CHUNK_BYTES // panel_bytes) * lanes
        y = torch.empty(m, n, dtype=torch.float32)
        threads = torch.get_num_threads()
        for n0 in range(0, n, rows):
            count = min(rows, n - n0)
            panels = -(-count // lanes)
            q = torch.empty(panels * k * lanes * bits // 8, dtype=torch.uint8)
            sz = torch.empty(panels * 2 * (k // group) * lanes, dtype=torch.float32)
            part = blocks[n0:n0 + count]
            rc = self._panels(part.data_ptr(), part.stride(0), ggml_type, count, k, lanes, q.data_ptr(),
                              sz.data_ptr(), threads)
            if rc != 0:
                raise ValueError(f"gguf panels rejected {count} rows of GGML type {ggml_type}, K {k}.")
            packed = PackedQuantWeight(q, sz, count, k, group, bits, int8_activations=True, amx=amx)
            y[:, n0:n0 + count] = repacked.matmul(x, packed, amx=amx)
        return y

    def product(self, x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, amx: bool = False) -> torch.Tensor:
        """x [M, K] float32 @ W^T -> [M, N] float32 by the way that serves M rows best: the as-stored kernel, from
        `ROWS_FROM` rows `matmul_rows` where it serves the type, else from `many_rows(ggml_type)` rows the decoded
        panels (`amx`: on AMX tiles where the int8 kernel has them, for a bf16 model's activations, as a repacked
        weight would; those take the panels from `many_rows(ggml_type)` rows whatever the type)."""
        m, k = x.shape
        panels = self.many_rows_serves(ggml_type, self._repacked)
        if amx and panels and m >= max(AMX_MIN_ROWS, many_rows(ggml_type)) and self._repacked.amx_for(True, k):
            return self.matmul_many_rows(x, blocks, ggml_type, self._repacked, amx=True)
        if m >= ROWS_FROM and ggml_type in self.rows_types:
            return self.matmul_rows(x, blocks, ggml_type)
        if m >= many_rows(ggml_type) and panels:
            return self.matmul_many_rows(x, blocks, ggml_type, self._repacked)
        return self.matmul(x, blocks, ggml_type)

    def matmul_rows(self, x: torch.Tensor, blocks: torch.Tensor, ggml_type: int,
                    threads: int | None = None) -> torch.Tensor:
        """x [M, K] float32 @ W^T -> [M, N] float32 through `csrc/gguf_rows.c` (see the module), for a type in
        `rows_types`; `threads` overrides the thread count the call's size asks for (tests, benchmarks)."""
        if ggml_type not in self.rows_types:
            raise ValueError(f"gguf rows matmul: GGML type {ggml_type} is not served here ({sorted(self.rows_types)}).")
        return self._call(self._fn_rows, "gguf rows matmul", x, blocks, ggml_type, threads)

    def serves(self, ggml_type: int) -> bool:
        """Whether `VX_CPU_MATMUL` and this CPU give a weight of `ggml_type` this kernel: `int8`, or `auto` where
        the dot products are VNNI ones (the choice the repacked int8 path makes too)."""
        mode = envs.VX_CPU_MATMUL.get()
        return ggml_type in self.types and (mode == "int8" or (mode == "auto" and self.vnni))

    def matmul(self, x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, threads: int | None = None) -> torch.Tensor:
        """x [M, K] float32 @ W^T -> [M, N] float32, W's N rows the uint8 rows of `blocks` [N, row bytes];
        `threads` overrides the thread count the call's size asks for (tests, benchmarks)."""
        return self._call(self._fn, "gguf matmul", x, blocks, ggml_type, threads)

    def _call(self, fn: Any, what: str, x: torch.Tensor, blocks: torch.Tensor, ggml_type: int,
              threads: int | None) -> torch.Tensor:
        """One C entry point's y = x @ W^T on checked arguments, into a new float32 [M, N]."""
        x, blocks = self._checked(x, blocks, ggml_type)
        m, k = x.shape
        n = blocks.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        threads = threads or threads_for(serial_us(m, blocks.shape[0] * blocks.shape[1]))
        rc = fn(x.data_ptr(), m, k, blocks.data_ptr(), blocks.stride(0), ggml_type, n, y.data_ptr(), n, threads)
        if rc != 0:
            raise ValueError(f"{what} rejected x {tuple(x.shape)} with {n} rows of {blocks.shape[1]} bytes of "
                             f"GGML type {ggml_type}.")
        return y

    def _checked(self, x: torch.Tensor, blocks: torch.Tensor, ggml_type: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x and blocks as the C kernels take them (contiguous x, rows of unit stride), or ValueError when their
        dtypes or widths do not fit `ggml_type`."""
        if x.dtype != torch.float32 or x.dim() != 2 or blocks.dtype != torch.uint8 or blocks.dim() != 2:
            raise ValueError(f"gguf matmul: x {x.dtype} {tuple(x.shape)} must be float32 [M, K], blocks "
                             f"{blocks.dtype} {tuple(blocks.shape)} uint8 [N, bytes].")
        k = x.shape[1]
        if blocks.shape[1] != self._row_bytes(ggml_type, k):
            raise ValueError(f"gguf matmul: rows of {blocks.shape[1]} bytes are not {k} weights of GGML type "
                             f"{ggml_type} (or the type is not served: {sorted(self.types)}).")
        return x.contiguous(), blocks if blocks.stride(1) == 1 else blocks.contiguous()


def default_libraries() -> tuple[Library, ...]:
    """The libraries `load_gguf_matmul_kernel()` builds, the int8 kernel's among them (a worker builds them before
    its model loads)."""
    return (Library(_SOURCE, _CFLAGS, (), _WHAT), _PANELS, _ROWS, *quant_matmul.default_libraries())


@functools.cache
def load_gguf_matmul_kernel(vnni: bool = True, wide: bool = True) -> GGUFMatmulKernel | None:
    """The kernel for this CPU, built if needed; None when kernels are off or cannot be built here. For the tests
    and benchmarks: `vnni=False` builds it as for an AVX2-only CPU (no AVX-512, no VNNI), `wide=False` without its
    512-bit Q4_K and Q6_K code (the 256-bit code every other build runs); neither has `matmul_rows` (512-bit
    only)."""
    flags = _CFLAGS if vnni else (*_CFLAGS, *_AVX2_ONLY)
    if not wide:
        flags = (*flags, "-DVX_GGUF_256")
    lib = load_library(_SOURCE, flags, (), _WHAT)
    if lib is None:
        return None
    # Without the panels' library or the int8 kernel (a failed build) every product takes the as-stored kernel.
    rows = _load(_ROWS) if vnni and wide else None
    return GGUFMatmulKernel(lib, _load(_PANELS), load_quant_matmul_kernel(), rows)


def _load(library: Library) -> ctypes.CDLL | None:
    return load_library(library.source, library.cflags, library.libs, library.what)
