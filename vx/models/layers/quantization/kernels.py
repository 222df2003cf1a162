"""The weight-only integer matmuls every quantization method ends in, one place to choose kernels.

Three layouts cover the formats vx loads. `Int4Groupwise` is affine 4-bit with a scale and a zero per group of
input features: w[n, k] = q[n, k] * scale[n, k // G] + zero[n, k // G], q in 0..15. GGUF Q4_0, Q4_1 and Q4_K, AWQ
and GPTQ are exactly this. `Int8Groupwise` is the same with q in -128..127: GGUF Q8_0, Q5_0, Q5_1 and Q5_K (groups
of 32) and Q6_K (groups of 16) are exactly this. `Int8PerChannel` is w[n, k] = q[n, k] * scale[n]. All are packed
once at load.

Kernels: torch's own (`_weight_int4pack_mm_for_cpu` / `_weight_int4pack_mm` on CUDA, `_weight_int8pack_mm`).
`Int8Groupwise.matmul` is a reference for now: it dequantizes the layer's weight per call.
"""

from __future__ import annotations

import torch

_CPU_N_MULTIPLE = 16  # torch's CPU int4 packing wants the output features in multiples of 16


class Int4Groupwise:
    """A packed affine 4-bit weight [N, K] with groups of `group_size` input features."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> None:
        """`q` [N, K] integers in 0..15; `scale`, `zero` [N, K / group_size] in the activations' dtype."""
        n, k = q.shape
        if k % group_size or scale.shape != (n, k // group_size) or zero.shape != scale.shape:
            raise ValueError(f"Int4Groupwise: q {tuple(q.shape)}, scale {tuple(scale.shape)}, zero "
                             f"{tuple(zero.shape)} do not fit groups of {group_size}.")
        self.out_features, self.in_features, self.group_size = n, k, group_size
        pad = -n % _CPU_N_MULTIPLE
        if pad:  # zero rows, cut off the output again
            q = torch.cat([q, q.new_zeros(pad, k)])
            scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
            zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
        # torch's kernels compute (q - 8) * scale + zero': fold the 8 into the zero.
        self.scales_and_zeros = torch.stack([scale, zero + 8 * scale], dim=-1).transpose(0, 1).contiguous()
        if q.device.type == "cpu":
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
        else:
            q_u8 = (q[:, 0::2].to(torch.uint8) << 4) | q[:, 1::2].to(torch.uint8)
            self.packed = torch.ops.aten._convert_weight_to_int4pack(q_u8.contiguous(), 8)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ W^T -> [..., N], in x's dtype."""
        shape = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        sz = self.scales_and_zeros if self.scales_and_zeros.dtype == x.dtype else self.scales_and_zeros.to(x.dtype)
        if x.device.type == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, sz)
        else:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group_size, sz)
        return y[:, :self.out_features].reshape(*shape, self.out_features)


class Int8PerChannel:
    """An int8 weight [N, K] with one scale per output feature."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        """`q` [N, K] int8; `scale` [N] in the activations' dtype."""
        if q.dtype != torch.int8 or scale.shape != (q.shape[0],):
            raise ValueError(f"Int8PerChannel: q {q.dtype} {tuple(q.shape)} with scale {tuple(scale.shape)}.")
        self.out_features, self.in_features = q.shape
        self.q, self.scale = q.contiguous(), scale.contiguous()

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ W^T -> [..., N], in x's dtype."""
        shape = x.shape[:-1]
        scale = self.scale if self.scale.dtype == x.dtype else self.scale.to(x.dtype)
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.q, scale)
        return y.reshape(*shape, self.out_features)


class Int8Groupwise:
    """An affine int8 weight [N, K] with a scale and a zero per group of `group_size` input features."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> None:
        """`q` [N, K] int8; `scale`, `zero` [N, K / group_size] in the activations' dtype."""
        n, k = q.shape
        if q.dtype != torch.int8 or k % group_size or scale.shape != (n, k // group_size) or zero.shape != scale.shape:
            raise ValueError(f"Int8Groupwise: q {q.dtype} {tuple(q.shape)}, scale {tuple(scale.shape)}, zero "
                             f"{tuple(zero.shape)} do not fit groups of {group_size}.")
        self.out_features, self.in_features, self.group_size = n, k, group_size
        self.q, self.scale, self.zero = q.contiguous(), scale.contiguous(), zero.contiguous()

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes + self.zero.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ W^T -> [..., N], in x's dtype."""
        groups = self.q.view(self.out_features, -1, self.group_size).to(x.dtype)
        weight = (groups * self.scale.to(x.dtype)[..., None] + self.zero.to(x.dtype)[..., None]).view(
            self.out_features, self.in_features)
        return torch.nn.functional.linear(x, weight)
