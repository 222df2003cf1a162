"""The weight-only integer matmuls every quantization method ends in, one place to choose kernels.

Three layouts cover the formats vx loads. `Int4Groupwise` is affine 4-bit with a scale and a zero per group of
input features: w[n, k] = q[n, k] * scale[n, k // G] + zero[n, k // G], q in 0..15. GGUF Q4_0, Q4_1 and Q4_K, AWQ
and GPTQ are exactly this. `Int8Groupwise` is the same with q in -128..127: GGUF Q8_0, Q5_0, Q5_1 and Q5_K (groups
of 32) and Q6_K (groups of 16) are exactly this. `Int8PerChannel` is w[n, k] = q[n, k] * scale[n]. All are packed
once at load, for the kernel chosen then (`.kernel` names it), and none ever makes a float copy of its weight.
The C kernel keeps scales and zeros in float32 whatever dtype they come in (in float16 when every one of them is a
float16 value, which changes none), so a caller may pass float32 ones to bf16 activations: rounding GGUF's fp16
scales to bf16 doubles the error of a bf16 product (measured: 3e-3 -> 6e-3).

Kernels, chosen by measurement (`vx bench quant_matmul`; figures in docs/performance.md):
- CPU: vx's C kernel (`vx.kernels.quant_matmul`) for all three layouts and every activation dtype: with float32
  activations torch's int4pack/int8pack ops run 10-30x slower than the float matmul they replace, and with bf16
  ones the C kernel (x converted to float32 and back, exact) measured at least as fast here. On CPUs with VNNI
  the kernel rounds x to int8 per group and sums integer products (`VX_CPU_MATMUL=auto`: measured ~2x faster
  than its float path at 1 to 128 rows; x's rounding errs by ~1% of a product, as llama.cpp's GGUF path does;
  `VX_CPU_MATMUL=float` keeps the exact path). Without a C
  compiler (or with VX_CPU_KERNELS=0): torch's `_weight_int4pack_mm_for_cpu` / `_weight_int8pack_mm` in x's
  own dtype (exact, slow in float32), and for Int8Groupwise a dequantization in bounded blocks of rows.
- CUDA: torch's `_weight_int4pack_mm` for Int4Groupwise; the blocks of rows for both int8 layouts (correct, not
  tuned, and not run here: no GPU was lent to this work; GPU kernels are another issue's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vx.kernels import torch_ops
from vx.kernels.quant_matmul import PackedQuantWeight, QuantMatmulKernel, load_quant_matmul_kernel

# What `.kernel` reports.
VX_CPU = "vx-cpu"                  # vx's C kernel
TORCH_INT4PACK = "torch-int4pack"  # _weight_int4pack_mm(_for_cpu)
TORCH_INT8PACK = "torch-int8pack"  # _weight_int8pack_mm
TORCH_BLOCKS = "torch-blocks"      # dequantize a block of rows, F.linear, next block

_CPU_N_MULTIPLE = 16  # torch's CPU int4 packing wants the output features in multiples of 16
# Float weights the block path dequantizes at a time: 4 MiB in float32, whatever the layer's size.
_BLOCK_ELEMENTS = 1 << 20


def _vx_cpu_kernel(device: torch.device) -> QuantMatmulKernel | None:
    """vx's C kernel where it serves (the CPU, when it builds here), else None."""
    kernel = load_quant_matmul_kernel() if device.type == "cpu" else None
    if kernel is not None:
        torch_ops.library()  # its operator, for the compiled decode's graphs
    return kernel


def _vx_cpu_matmul(kernel: QuantMatmulKernel, packed: PackedQuantWeight, x: torch.Tensor,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] in any float dtype through the float32 kernel, back in `out_dtype` (default x's; converting x
    costs M x K, the result M x N: an LM head that wants float32 logits asks for them, sparing two passes).

    A traced graph (compiled decode) calls the kernel as the opaque `vx::quant_matmul` operator; eager code calls
    it directly, without the dispatcher's few microseconds a call.
    """
    x2 = x.reshape(-1, packed.in_features).to(torch.float32)
    # The AMX path rounds x to bf16: only a bf16 model's activations, which that leaves as they are (a float32 model
    # keeps the int8 path's rounding, the same on every tensor-parallel rank as on the whole model).
    amx = packed.amx and x.dtype == torch.bfloat16
    if torch_ops.tracing(x):
        y = torch.ops.vx.quant_matmul(x2, packed.q, packed.sz, packed.out_features, packed.group_size, packed.bits,
                                      packed.int8_activations, amx)
    else:
        y = kernel.matmul(x2, packed, amx=None if amx else False)
    return y.to(out_dtype or x.dtype).reshape(*x.shape[:-1], packed.out_features)


def _check_groups(name: str, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> None:
    n, k = q.shape
    if group_size < 1 or k % group_size or scale.shape != (n, k // group_size) or zero.shape != scale.shape:
        raise ValueError(f"{name}: q {tuple(q.shape)}, scale {tuple(scale.shape)}, zero "
                         f"{tuple(zero.shape)} do not fit groups of {group_size}.")


class _QuantizedWeight:
    """What the layouts share: packed once for vx's C kernel where it serves (then `kernel` is VX_CPU), else kept for
    a torch path of the layout's own (`_torch_nbytes`, `_torch_matmul`)."""

    kernel: str
    _packed: PackedQuantWeight

    def _pack_for_vx(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                     bits: int) -> bool:
        """Pack for vx's C kernel; False where it does not serve (the caller then keeps a torch layout)."""
        self._vx = _vx_cpu_kernel(q.device)
        if self._vx is None:
            return False
        self.kernel = VX_CPU
        self._packed = self._vx.pack(q, scale, zero, group_size, bits=bits)
        return True

    @property
    def nbytes(self) -> int:
        """Bytes the packed weight holds (integers, scales and zeros)."""
        return self._packed.nbytes if self._vx is not None else self._torch_nbytes()

    @property
    def can_dequantize_rows(self) -> bool:
        """Whether `dequantize_rows` reads rows back out of this weight (vx's C kernel layout)."""
        return self._vx is not None

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """W[rows] [R, K] in float32 (a tied token embedding's lookup); only where `can_dequantize_rows`."""
        return self._packed.dequantize_rows(rows)

    def matmul(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [..., K] @ W^T -> [..., N], in `out_dtype` (default x's)."""
        if self._vx is not None:
            return _vx_cpu_matmul(self._vx, self._packed, x, out_dtype)
        return self._torch_matmul(x).to(out_dtype or x.dtype)

    def _torch_nbytes(self) -> int:
        raise NotImplementedError

    def _torch_matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int4Groupwise(_QuantizedWeight):
    """A packed affine 4-bit weight [N, K] with groups of `group_size` input features."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> None:
        """`q` [N, K] integers in 0..15; `scale`, `zero` [N, K / group_size] in the activations' dtype."""
        _check_groups("Int4Groupwise", q, scale, zero, group_size)
        n, k = q.shape
        self.out_features, self.in_features, self.group_size = n, k, group_size
        if self._pack_for_vx(q, scale, zero, group_size, bits=4):
            return
        self.kernel = TORCH_INT4PACK
        pad = -n % _CPU_N_MULTIPLE
        if pad:  # zero rows, cut off the output again
            q = torch.cat([q, q.new_zeros(pad, k)])
            scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
            zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
        # torch's kernels compute (q - 8) * scale + zero': fold the 8 into the zero.
        self._scales_and_zeros = torch.stack([scale, zero + 8 * scale], dim=-1).transpose(0, 1).contiguous()
        if q.device.type == "cpu":
            self._int4pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
        else:
            q_u8 = (q[:, 0::2].to(torch.uint8) << 4) | q[:, 1::2].to(torch.uint8)
            self._int4pack = torch.ops.aten._convert_weight_to_int4pack(q_u8.contiguous(), 8)

    def _torch_nbytes(self) -> int:
        return self._int4pack.nbytes + self._scales_and_zeros.nbytes

    def _torch_matmul(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        sz = self._scales_and_zeros
        sz = sz if sz.dtype == x.dtype else sz.to(x.dtype)
        if x.device.type == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self._int4pack, self.group_size, sz)
        else:
            y = torch.ops.aten._weight_int4pack_mm(x2, self._int4pack, self.group_size, sz)
        return y[:, :self.out_features].reshape(*shape, self.out_features)


class Int8PerChannel(_QuantizedWeight):
    """An int8 weight [N, K] with one scale per output feature."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        """`q` [N, K] int8; `scale` [N] in the activations' dtype."""
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
            raise ValueError(f"Int8PerChannel: q {q.dtype} {tuple(q.shape)} with scale {tuple(scale.shape)}.")
        self.out_features, self.in_features = q.shape
        # For the C kernel: one group spanning K, zero 0.
        if self._pack_for_vx(q, scale[:, None], torch.zeros_like(scale[:, None]), self.in_features, bits=8):
            return
        self.kernel = TORCH_INT8PACK if q.device.type == "cpu" else TORCH_BLOCKS
        self._q, self._scale = q.contiguous(), scale.contiguous()

    def _torch_nbytes(self) -> int:
        return self._q.nbytes + self._scale.nbytes

    def _torch_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == TORCH_BLOCKS:
            return _dequantized_blocks(x, self._q, self._scale[:, None], None, self.in_features)
        shape = x.shape[:-1]
        scale = self._scale if self._scale.dtype == x.dtype else self._scale.to(x.dtype)
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self._q, scale)
        return y.reshape(*shape, self.out_features)


class Int8Groupwise(_QuantizedWeight):
    """An affine int8 weight [N, K] with a scale and a zero per group of `group_size` input features."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> None:
        """`q` [N, K] int8; `scale`, `zero` [N, K / group_size] in the activations' dtype."""
        if q.dtype != torch.int8:
            raise ValueError(f"Int8Groupwise: q {q.dtype} {tuple(q.shape)} is not int8.")
        _check_groups("Int8Groupwise", q, scale, zero, group_size)
        n, k = q.shape
        self.out_features, self.in_features, self.group_size = n, k, group_size
        if self._pack_for_vx(q, scale, zero, group_size, bits=8):
            return
        self.kernel = TORCH_BLOCKS
        self._q, self._scale, self._zero = q.contiguous(), scale.contiguous(), zero.contiguous()

    def _torch_nbytes(self) -> int:
        return self._q.nbytes + self._scale.nbytes + self._zero.nbytes

    def _torch_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return _dequantized_blocks(x, self._q, self._scale, self._zero, self.group_size)


def _dequantized_blocks(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                        group_size: int) -> torch.Tensor:
    """The torch path of the int8 layouts: dequantize `_BLOCK_ELEMENTS` weights' worth of rows at a time into x's
    dtype and multiply, so memory stays bounded whatever the layer's size."""
    n, k = q.shape
    rows = max(1, _BLOCK_ELEMENTS // k)
    out = x.new_empty(*x.shape[:-1], n)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        w = q[n0:n1].view(n1 - n0, k // group_size, group_size).to(x.dtype) * scale[n0:n1, :, None].to(x.dtype)
        if zero is not None:
            w += zero[n0:n1, :, None].to(x.dtype)
        out[..., n0:n1] = F.linear(x, w.view(n1 - n0, k))
    return out
