"""GGUF's block layouts, unpacked: raw rows of a quantized tensor (the bytes as the file holds them) become the affine
integer form the kernels take, w = q * scale + zero per group of input features.

Every type vx loads is exactly this form. Q4_0 and Q4_1 are 4-bit with a scale (and a minimum) per block of 32;
Q4_K is 4-bit with a 6-bit scale and minimum per 32, times the super-block's f16 `d` and `dmin`; Q8_0, Q5_0, Q5_1
and Q5_K are the same with 8 or 5 bits (q fits int8); Q6_K is 6-bit with a signed 8-bit scale per 16; IQ4_XS holds
4-bit indices into a fixed table of 16 int8 values (q is the value) with a 6-bit scale per 32. Nothing is rounded
here: the scales are products of an f16 and a small integer, exact in float32.

Vectorized torch over whole rows, so it runs on the device the rows are on: at load for every row of a weight, and
per step for the rows of the token embedding that a batch gathers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType

FLOAT_TYPES: dict[int, torch.dtype] = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
"""The float types: their rows are the numbers themselves."""

QUANTIZED_TYPES: tuple[int, ...] = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS)
"""The block formats vx unpacks (those of the common Q4_K_M / Q5_K_M / Q8_0 / IQ4_XS files)."""

SUPPORTED_TYPES: tuple[int, ...] = (*FLOAT_TYPES, *QUANTIZED_TYPES)

_FOUR_BIT = (T.Q4_0, T.Q4_1, T.Q4_K)


class GroupwiseInts(NamedTuple):
    """A weight as integers and a scale and zero per group: w[n, k] = q[n, k] * scale[n, g] + zero[n, g] with
    g = k // group_size."""

    q: torch.Tensor  # [rows, K]: uint8 in 0..15 when bits == 4, else int8
    scale: torch.Tensor  # [rows, K // group_size] float32
    zero: torch.Tensor  # [rows, K // group_size] float32
    group_size: int
    bits: int  # 4 or 8: which kernel takes it

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [rows, K]."""
        rows, k = self.q.shape
        groups = self.q.reshape(rows, -1, self.group_size).float()
        return (groups * self.scale[..., None] + self.zero[..., None]).reshape(rows, k)


def type_name(ggml_type: int) -> str:
    """The GGML name of a type number ("Q4_K"), or the number when GGML has no such type."""
    try:
        return T(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def row_features(ggml_type: int, row_bytes: int) -> int:
    """How many weights a row of `row_bytes` bytes holds."""
    block, size = GGML_QUANT_SIZES[T(ggml_type)]
    if row_bytes % size:
        raise ValueError(f"A {type_name(ggml_type)} row of {row_bytes} bytes is not a whole number of blocks.")
    return row_bytes // size * block


def row_bytes(ggml_type: int, features: int) -> int:
    """How many bytes a row of `features` weights takes."""
    block, size = GGML_QUANT_SIZES[T(ggml_type)]
    if features % block:
        raise ValueError(f"{type_name(ggml_type)} needs rows of a multiple of {block} weights, not {features}.")
    return features // block * size


def as_float(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """Rows of a float type, as their own dtype (a view of the bytes)."""
    return raw.view(FLOAT_TYPES[ggml_type])


def dequantize(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """Raw rows [rows, bytes] of any supported type -> float32 [rows, K]."""
    if ggml_type in FLOAT_TYPES:
        return as_float(raw, ggml_type).float()
    return unpack(raw, ggml_type).dequantize()


def unpack(raw: torch.Tensor, ggml_type: int) -> GroupwiseInts:
    """Raw rows [rows, bytes] (uint8) of a quantized type -> its integers, scales and zeros."""
    if ggml_type not in _UNPACKERS:
        raise ValueError(f"GGUF type {type_name(ggml_type)} cannot be unpacked; vx unpacks "
                         f"{', '.join(type_name(t) for t in QUANTIZED_TYPES)}.")
    if raw.dtype != torch.uint8 or raw.dim() != 2:
        raise ValueError(f"unpack takes rows of bytes [rows, bytes] (uint8), got {raw.dtype} {tuple(raw.shape)}.")
    _, size = GGML_QUANT_SIZES[T(ggml_type)]
    rows, nbytes = raw.shape
    if nbytes % size:
        raise ValueError(f"A {type_name(ggml_type)} row of {nbytes} bytes is not a whole number of blocks.")
    blocks = raw.reshape(rows, nbytes // size, size)
    q, scale, zero, group = _UNPACKERS[ggml_type](blocks)
    return GroupwiseInts(q.reshape(rows, -1), scale.reshape(rows, -1).float(), zero.reshape(rows, -1).float(),
                         group, 4 if ggml_type in _FOUR_BIT else 8)


# Each unpacker takes blocks [rows, nb, type_size] and returns q [rows, nb, ...], scale and zero [rows, nb, groups]
# (or [rows, nb] for one group per block), and the group size.

def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 at byte `at` of every block, as float32 [rows, nb]."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16)[..., 0].float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: the n low nibbles, then the n high ones (GGML's order within a run)."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _bits(packed: torch.Tensor, count: int, step: int = 1) -> torch.Tensor:
    """[..., n] bytes -> [..., count, n]: field i is (byte >> (i * step)) & (2**step - 1)."""
    shifts = torch.arange(0, count * step, step, dtype=torch.uint8, device=packed.device)
    return (packed[..., None, :] >> shifts[:, None]) & ((1 << step) - 1)


def _high_bits_32(qh: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes (a little-endian u32) -> [..., 32]: bit j is the high bit of weight j."""
    return _bits(qh, 8).transpose(-1, -2).reshape(*qh.shape[:-1], 32)


def _q4_0(b: torch.Tensor):
    d = _f16(b, 0)
    return _nibbles(b[..., 2:18]), d, -8 * d, 32  # d * (q - 8)


def _q4_1(b: torch.Tensor):
    return _nibbles(b[..., 4:20]), _f16(b, 0), _f16(b, 2), 32  # d * q + m


def _q5_0(b: torch.Tensor):
    q = _nibbles(b[..., 6:22]) | (_high_bits_32(b[..., 2:6]) << 4)
    d = _f16(b, 0)
    return (q.to(torch.int8) - 16), d, torch.zeros_like(d), 32  # d * (q - 16)


def _q5_1(b: torch.Tensor):
    q = _nibbles(b[..., 8:24]) | (_high_bits_32(b[..., 4:8]) << 4)
    return q.to(torch.int8), _f16(b, 0), _f16(b, 2), 32  # d * q + m


def _q8_0(b: torch.Tensor):
    d = _f16(b, 0)
    return b[..., 2:34].contiguous().view(torch.int8), d, torch.zeros_like(d), 32  # d * q


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> the 8 sub-blocks' 6-bit scales and minimums [..., 8]. Bytes 0-3 hold scales 0-3
    (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same for the minimums, bytes 8-11 the low 4
    bits of scales 4-7 (low nibble) and minimums 4-7 (high nibble)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: 128 bytes -> [..., 8, 32]: each run of 32 bytes holds sub-block 2j (low nibbles) and 2j + 1
    (high nibbles)."""
    runs = qs.reshape(*qs.shape[:-1], 4, 32)
    return torch.stack([runs & 0x0F, runs >> 4], dim=-2).reshape(*qs.shape[:-1], 8, 32)


def _q4_k(b: torch.Tensor):
    sc, mn = _k_scales(b[..., 4:16])
    d, dmin = _f16(b, 0)[..., None], _f16(b, 2)[..., None]
    return _k_low_nibbles(b[..., 16:144]), d * sc, -(dmin * mn), 32  # d * sc * q - dmin * m


def _q5_k(b: torch.Tensor):
    sc, mn = _k_scales(b[..., 4:16])
    d, dmin = _f16(b, 0)[..., None], _f16(b, 2)[..., None]
    q = _k_low_nibbles(b[..., 48:176]) | (_bits(b[..., 16:48], 8) << 4)  # bit i of byte l: weight 32 i + l
    return q.to(torch.int8), d * sc, -(dmin * mn), 32


def _q6_k(b: torch.Tensor):
    lead = b.shape[:-1]
    # Low 4 bits: two runs of 64 bytes, each the low nibbles of 64 weights then the high nibbles of the next 64.
    low = _nibbles(b[..., 0:128].reshape(*lead, 2, 64)).reshape(*lead, 256)
    # High 2 bits: two runs of 32 bytes, each holding 4 fields of 2 bits for 4 x 32 weights.
    high = _bits(b[..., 128:192].reshape(*lead, 2, 32), 4, step=2).reshape(*lead, 256)
    q = (low | (high << 4)).to(torch.int8) - 32
    d = _f16(b, 208)[..., None]
    scale = d * b[..., 192:208].contiguous().view(torch.int8).float()
    return q, scale, torch.zeros_like(scale), 16  # d * sc * (q - 32)


IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
"""IQ4_XS's (and IQ4_NL's) weight values, indexed by a block's nibbles (GGML's kvalues_iq4nl)."""


def _iq4_xs(b: torch.Tensor):
    lead = b.shape[:-1]
    # Sub-block j's 6-bit scale: nibble j % 2 of byte 4 + j / 2 below, bits 2j-2j+1 of the u16 at byte 2 above.
    low = _bits(b[..., 4:8], 2, step=4).transpose(-1, -2).reshape(*lead, 8)
    high = _bits(b[..., 2:4], 4, step=2).transpose(-1, -2).reshape(*lead, 8)
    scale = _f16(b, 0)[..., None] * ((low | (high << 4)).float() - 32)
    values = torch.tensor(IQ4_VALUES, dtype=torch.int8, device=b.device)
    q = values[_nibbles(b[..., 8:136].reshape(*lead, 8, 16)).long()]  # runs of 16 bytes: sub-block j's nibbles
    return q, scale, torch.zeros_like(scale), 32  # d * (ls - 32) * V[q]


_UNPACKERS = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0,
              T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k, T.IQ4_XS: _iq4_xs}
