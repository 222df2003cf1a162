"""The CPU attention backend's C kernel (`csrc/paged_decode.c`), built on first use by `vx.kernels.build`.

Without a compiler, when the build fails, or with `VX_CPU_KERNELS=0`, `load_paged_decode_kernel()` returns None
and the caller keeps its pure-PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from vx.kernels.build import load_library

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
# -ffast-math lets gcc vectorize the exponentials (glibc's libmvec) and reassociate the dot products. It is
# given to the compile step only (vx.kernels.build links without it: crtfastmath.o would switch the whole
# process to flush-to-zero).
_CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
_LIBS = ("-lmvec", "-lm")


class PagedDecodeKernel:
    """Decode attention (one query token per sequence) over the paged KV cache, read in place (float32)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.vx_paged_decode_f32
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [p, i64, p, p, p, p, i64, p, i64, i64, i64, i64, i64, ctypes.c_float, i64, p, i64, p,
                       ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(self, q: torch.Tensor, q_rows: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int | None, out: torch.Tensor,
                 num_heads: int) -> bool:
        """out[q_rows[i]] = attention of q[q_rows[i]] over sequence i's first seq_lens[i] cached tokens.

        q, out: float32 [T, H * D], each row contiguous (q may be a column slice of a wider projection);
        kv_cache: contiguous [2, num_blocks, block_size, Hk, D]; block_table: int32 [S, nb] contiguous; seq_lens:
        int32 [S]; q_rows: int64 [S]. Returns False (nothing written) for what the kernel does not handle, so
        the caller can fall back.
        """
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        if (q.dim() != 2 or out.dim() != 2 or q.stride(1) != 1 or out.stride(1) != 1
                or q.shape[1] != num_heads * head_dim or not kv_cache.is_contiguous()
                or not block_table.is_contiguous()):
            return False
        rc = self._fn(q.data_ptr(), q.stride(0), q_rows.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                      block_table.data_ptr(), block_table.shape[1], seq_lens.data_ptr(), seq_lens.shape[0],
                      num_heads, num_kv_heads, head_dim, block_size, scale, window or 0, out.data_ptr(),
                      out.stride(0), q_rows.data_ptr(), torch.get_num_threads())
        return rc == 0


@functools.cache
def load_paged_decode_kernel() -> PagedDecodeKernel | None:
    """The paged decode kernel, built if needed; None when kernels are off or cannot be built here."""
    lib = load_library(_SOURCE, _CFLAGS, _LIBS, "CPU attention kernel")
    return None if lib is None else PagedDecodeKernel(lib)
