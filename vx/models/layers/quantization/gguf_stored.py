"""A GGUF weight kept as the file stores it: its raw rows of blocks, multiplied by vx's as-stored C kernel
(vx.kernels.gguf_matmul), so a step reads the file's bytes and no more (Q4_K: 4.5 bits a weight, against 5 for
the repacked 4-bit layout; Q6_K: 6.56 against 10; Q5_0: 5.5 against 9, IQ4_XS 4.25 against 9).

Chosen at load for a GGUF tensor of a type the kernel serves, on the CPU, when `VX_CPU_MATMUL` asks for int8
activations (`int8`, or `auto` on a CPU with VNNI): the repacked int8 path rounds x the same way, per group of 32
there and per block of 256 (Q4_K, Q5_K, Q6_K) or 32 (the other types) here. `VX_CPU_MATMUL=float` keeps the exact
repacked path. Q4_0, Q4_1 and Q8_0 repack into as many bits a weight as the file holds, so as stored they save
no bytes; below `STORED_FROM_BYTES` (the default model's layers) the repacked kernel's lower cost per call wins
and they are repacked, above it the as-stored kernel is the faster (docs/performance.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from gguf import GGMLQuantizationType

from vx.kernels import torch_ops
from vx.kernels.gguf_matmul import GGUFMatmulKernel, load_gguf_matmul_kernel
from vx.models.layers.quantization.gguf_blocks import row_features, unpack

VX_CPU_GGUF = "vx-cpu-gguf"  # what `.kernel` reports


class RawBlocks(NamedTuple):
    """Raw rows [rows, bytes] (uint8) of one GGML type, as the file holds them."""

    rows: torch.Tensor
    ggml_type: int


# The types whose repacked layout holds the file's bits a weight (groups of 32 with float16 scales, as the blocks).
SAME_BITS_REPACKED = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0})
# From this many bytes a weight of those types is kept as stored.
STORED_FROM_BYTES = 1 << 20


def stored_kernel_for(ggml_type: int, device: torch.device, nbytes: int | None = None) -> GGUFMatmulKernel | None:
    """The as-stored kernel when it serves a weight of `ggml_type` and `nbytes` on `device` (see the module), else
    None."""
    if device.type != "cpu":
        return None
    if ggml_type in SAME_BITS_REPACKED and nbytes is not None and nbytes < STORED_FROM_BYTES:
        return None
    kernel = load_gguf_matmul_kernel()
    if kernel is None or not kernel.serves(ggml_type):
        return None
    torch_ops.library()  # its operator, for the compiled decode's graphs
    return kernel


class StoredGGUFWeight:
    """A weight [N, K] as raw GGUF rows of one type, behind the kernels' interface (`matmul`, `nbytes`,
    `dequantize_rows` for a token embedding tied to it)."""

    kernel = VX_CPU_GGUF
    can_dequantize_rows = True

    def __init__(self, blocks: torch.Tensor, ggml_type: int, matmul_kernel: GGUFMatmulKernel) -> None:
        """`blocks` [N, row bytes] uint8: copied only where the rows are not one contiguous run (a shard's view of
        the file stays one)."""
        self.blocks = blocks.contiguous()
        self.ggml_type = ggml_type
        self.out_features = blocks.shape[0]
        self.in_features = row_features(ggml_type, blocks.shape[1])
        self._kernel = matmul_kernel

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """W[rows] [R, K] in float32, exactly as gguf dequantizes them."""
        return unpack(self.blocks[rows], self.ggml_type).dequantize()

    def matmul(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [..., K] @ W^T -> [..., N] in `out_dtype` (default x's): the as-stored kernel, or for many rows the
        decoded panels (vx.kernels.gguf_matmul). A traced graph (compiled decode) calls the kernel as the opaque
        `vx::gguf_matmul` operator; eager code calls it directly."""
        x2 = x.reshape(-1, self.in_features).to(torch.float32)
        # Many rows of a bf16 model may multiply on AMX tiles (x rounded to bf16, which it already is).
        amx = x.dtype == torch.bfloat16
        if torch_ops.tracing(x):
            y = torch.ops.vx.gguf_matmul(x2, self.blocks, self.ggml_type, amx)
        else:
            y = self._kernel.product(x2, self.blocks, self.ggml_type, amx)
        return y.to(out_dtype or x.dtype).reshape(*x.shape[:-1], self.out_features)
