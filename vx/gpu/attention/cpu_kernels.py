"""The CPU attention backend's C kernel (`csrc/paged_decode.c`), built on first use by `vx.kernels.build`.

Without a compiler, when the build fails, or with `VX_CPU_KERNELS=0`, `load_paged_decode_kernel()` returns None
and the caller keeps its pure-PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from vx.gpu.attention.backend import KVCacheWrite, slot_views
from vx.gpu.attention.kv_format import KV_CACHE_FORMATS, KVCacheFormat, kv_cache_format
from vx.kernels.build import Library, load_library
from vx.kernels.threads import min_parallel_us

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
# -ffast-math lets gcc vectorize the exponentials (glibc's libmvec) and reassociate the dot products. It is
# given to the compile step only (vx.kernels.build links without it: crtfastmath.o would switch the whole
# process to flush-to-zero).
_CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
_LIBS = ("-lmvec", "-lm")
# One thread's time per (cached token, KV head) read, in µs (float32 cache, 3 query heads per KV head, head_dim
# 64: 105 µs for 1024 tokens x 3 KV heads, 6.6 ms for 8 x 4096 x 3); the kernel wakes its team above the work
# that `vx.kernels.threads` says is worth it.
_US_PER_TOKEN_HEAD = 0.05


# (kv_cache_dtype, the cache's dtype) -> the kernel's kv_kind (csrc/paged_decode.c: KV_F32, KV_FP8, KV_INT8, KV_BF16,
# KV_F16). "auto" stores the model's dtype.
_KV_KINDS = {("auto", torch.float32): 0, ("fp8_e4m3", torch.float8_e4m3fn): 1, ("int8", torch.int8): 2,
             ("auto", torch.bfloat16): 3, ("auto", torch.float16): 4}
_MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The q/out dtypes the kernel reads and writes itself (its io_kind).
_IO_KINDS = {torch.float32: 0, torch.bfloat16: 3}


class PagedDecodeKernel:
    """Decode attention (one query token per sequence) over the paged KV cache, read in place.

    q and out are float32, bfloat16 or float16; the cache is in the model's dtype, or quantized (fp8_e4m3, int8).
    Whatever it holds is decoded into float32 as it is read, and the arithmetic is float32's. The kernel reads and
    writes float32 and bfloat16 rows itself; float16 ones go through float32 copies.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.vx_paged_decode
        p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        fn.argtypes = [p, i64, p, p, p, i64, i64, f32, f32, p, i64, p, i64, i64, i64, i64, i64, f32, i64, p, i64, p,
                       ctypes.c_int, i64, i64, p, p, i64, i64, p, i64]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(self, q: torch.Tensor, q_rows: torch.Tensor | None, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int | None, out: torch.Tensor,
                 num_heads: int, kv_format: KVCacheFormat = KV_CACHE_FORMATS["auto"],
                 write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> bool:
        """out[q_rows[i]] = attention of q[q_rows[i]] over sequence i's first seq_lens[i] cached tokens.

        q, out: [T, H * D] in one of the model dtypes, each row contiguous (q may be a column slice of a wider
        projection); kv_cache: contiguous [2, num_blocks, block_size, Hk, row] in `kv_format`; block_table: int32
        [S, nb] contiguous; seq_lens: int32 [S]; q_rows: int64 [S], or None for rows 0..S-1. `write`: (k, v, slots),
        the step's new rows [N, Hk * row] already in the cache's dtype and format (each row contiguous) and their
        int64 slots, stored first. Returns False (nothing written) for what the kernel does not handle, so the
        caller can fall back.
        """
        _, _, block_size, num_kv_heads, width = kv_cache.shape
        head_dim = q.shape[1] // num_heads if q.dim() == 2 else 0
        kind = _KV_KINDS.get((kv_format.name, kv_cache.dtype))
        if (kind is None or q.dtype not in _MODEL_DTYPES or out.dtype != q.dtype
                or q.dim() != 2 or out.dim() != 2 or q.stride(1) != 1 or out.stride(1) != 1
                or q.shape[1] != num_heads * head_dim or width != kv_format.row_width(head_dim)
                or not kv_cache.is_contiguous() or not block_table.is_contiguous()
                or (write is not None and not _writable(write, kv_cache))):
            return False
        if q.dtype in _IO_KINDS:
            return self._run(q, q_rows, kv_cache, kind, width, kv_format, block_table, seq_lens, num_heads,
                             num_kv_heads, head_dim, block_size, scale, window, out, write)
        # A float16 model: its decode rows' queries in float32 (a few KB), the outputs rounded once into `out`.
        q32 = (q if q_rows is None else q.index_select(0, q_rows)).float()
        out32 = torch.empty_like(q32)
        if not self._run(q32, None, kv_cache, kind, width, kv_format, block_table, seq_lens, num_heads,
                         num_kv_heads, head_dim, block_size, scale, window, out32, write):
            return False
        if q_rows is None:
            out.copy_(out32)
        else:
            out.index_copy_(0, q_rows, out32.to(out.dtype))
        return True

    def _run(self, q: torch.Tensor, q_rows: torch.Tensor | None, kv_cache: torch.Tensor, kind: int, width: int,
             kv_format: KVCacheFormat, block_table: torch.Tensor, seq_lens: torch.Tensor, num_heads: int,
             num_kv_heads: int, head_dim: int, block_size: int, scale: float, window: int | None,
             out: torch.Tensor, write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> bool:
        rows = None if q_rows is None else q_rows.data_ptr()
        k_new, v_new, slots = write if write is not None else (None, None, None)
        rc = self._fn(q.data_ptr(), q.stride(0), rows, kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                      kind, width * kv_cache.element_size(), kv_format.tensor_scale, kv_format.tensor_scale,
                      block_table.data_ptr(), block_table.shape[1], seq_lens.data_ptr(), seq_lens.shape[0],
                      num_heads, num_kv_heads, head_dim, block_size, scale, window or 0, out.data_ptr(),
                      out.stride(0), rows, torch.get_num_threads(), _min_parallel_work(), _IO_KINDS[q.dtype],
                      None if k_new is None else k_new.data_ptr(), None if v_new is None else v_new.data_ptr(),
                      0 if k_new is None else k_new.stride(0) * k_new.element_size(),
                      0 if v_new is None else v_new.stride(0) * v_new.element_size(),
                      None if slots is None else slots.data_ptr(), 0 if slots is None else slots.shape[0])
        return rc == 0


def _writable(write: tuple[torch.Tensor, torch.Tensor, torch.Tensor], kv_cache: torch.Tensor) -> bool:
    """Whether the kernel can store these new rows itself: [N, Hk * row] in the cache's dtype, each row contiguous
    (k and v may have different row strides: one may be a slice of the qkv projection, the other a fresh tensor),
    int64 slots."""
    k, v, slots = write
    token_elems = kv_cache.shape[-2] * kv_cache.shape[-1]
    return (k.dim() == v.dim() == 2 and k.dtype == v.dtype == kv_cache.dtype and k.shape == v.shape
            and k.shape[1] == token_elems and k.stride(1) == v.stride(1) == 1
            and slots.dtype == torch.int64 and slots.dim() == 1 and slots.is_contiguous()
            and slots.shape[0] == k.shape[0])


def _min_parallel_work() -> int:
    """The (cached tokens x KV heads) of a call below which the kernel runs on the calling thread alone."""
    limit = min_parallel_us()
    return 2**62 if limit == float("inf") else int(limit / _US_PER_TOKEN_HEAD)


def _paged_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float, window: int, num_heads: int, kv_cache_dtype: str) -> torch.Tensor:
    """`vx::paged_decode_attention`: store the step's k/v rows at their slots, then decode row i of q over
    sequence i (every row is a decode)."""
    fmt = kv_cache_format(kv_cache_dtype)
    n = q.shape[0]
    out = torch.empty_like(q)
    kernel = load_paged_decode_kernel()
    if kernel is None:
        raise RuntimeError("vx::paged_decode_attention: the CPU paged decode kernel is not available here.")
    # The kernel stores the step's rows itself when they come in the cache's dtype (a ~30 µs a layer saved at
    # batch 1 against the index_copy_ writes below).
    if not fmt.quantized and kernel(q, None, kv_cache, block_table, seq_lens, scale, window or None, out, num_heads,
                                    fmt, write=(k.reshape(n, -1), v.reshape(n, -1), slot_mapping)):
        return out
    num_kv_heads = kv_cache.shape[-2]
    k, v = k.reshape(n, num_kv_heads, -1), v.reshape(n, num_kv_heads, -1)
    if fmt.quantized:
        k, v = fmt.store(k, kv_cache.dtype), fmt.store(v, kv_cache.dtype)
    KVCacheWrite(slot_mapping, None).apply(*slot_views(kv_cache), k, v)
    if not kernel(q, None, kv_cache, block_table, seq_lens, scale, window or None, out, num_heads, fmt):
        raise RuntimeError("vx::paged_decode_attention: the CPU paged decode kernel cannot serve this layer.")
    return out


@functools.cache
def register_paged_decode_op() -> torch.library.Library:
    """Define `vx::paged_decode_attention` (once per process): the kernel as an operator a compiled graph calls.

    The operator does not declare that it writes `kv_cache`: only this operator reads or writes a layer's cache,
    once per layer and step, so no other node's order depends on the write, and a declared mutation would make
    the compiler copy the whole cache each step.
    """
    lib = torch.library.Library("vx", "FRAGMENT")
    lib.define("paged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor kv_cache, Tensor slot_mapping, "
               "Tensor block_table, Tensor seq_lens, float scale, int window, int num_heads, str kv_cache_dtype) "
               "-> Tensor")
    lib.impl("paged_decode_attention", _paged_decode_attention, "CPU")
    lib.impl("paged_decode_attention", lambda q, *args: torch.empty_like(q), "Meta")
    return lib


LIBRARY = Library(_SOURCE, _CFLAGS, _LIBS, "CPU attention kernel")
"""What `load_paged_decode_kernel` builds (a worker builds it before its model loads)."""


@functools.cache
def load_paged_decode_kernel() -> PagedDecodeKernel | None:
    """The paged decode kernel, built if needed; None when kernels are off or cannot be built here."""
    lib = load_library(LIBRARY.source, LIBRARY.cflags, LIBRARY.libs, LIBRARY.what)
    return None if lib is None else PagedDecodeKernel(lib)
