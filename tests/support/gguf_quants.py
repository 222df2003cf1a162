"""Quantize float rows into GGUF blocks for tests: `gguf.quants.quantize` where the gguf package has a quantizer
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), and a plain round-to-nearest one of our own for the K-quants and IQ4_XS (the package
only dequantizes those). The K-quantizers aim at valid blocks, not at llama.cpp's error-minimizing search: what a test
checks is that vx reads the blocks as `gguf.quants.dequantize` does.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

T = GGMLQuantizationType


def quantize(rows: np.ndarray, qtype: int) -> np.ndarray:
    """float rows [n, k] -> raw blocks [n, bytes] (uint8), or the rows themselves for F32 / F16."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    qtype = T(qtype)
    if qtype in _K_QUANTIZERS:
        block, size = GGML_QUANT_SIZES[qtype]
        blocks = rows.reshape(-1, block)
        return _K_QUANTIZERS[qtype](blocks).reshape(rows.shape[0], rows.shape[1] // block * size)
    return quants.quantize(rows, qtype)


def random_blocks(rows: int, features: int, qtype: int, rng: np.random.Generator) -> np.ndarray:
    """Raw blocks of random bytes (every bit pattern of the integer and scale fields), with finite f16 scales."""
    block, size = GGML_QUANT_SIZES[T(qtype)]
    raw = rng.integers(0, 256, (rows, features // block, size), dtype=np.uint8)
    for at in _F16_FIELDS[T(qtype)]:
        raw[..., at:at + 2] = rng.uniform(-0.05, 0.05, raw.shape[:2]).astype(np.float16).view(np.uint8).reshape(
            *raw.shape[:2], 2)
    return raw.reshape(rows, -1)


# Where each type keeps its f16 fields (d, and m or dmin).
_F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q4_K: (0, 2),
               T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_XS: (0,)}


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(x.shape[0], 2)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0, a / np.where(b == 0, 1, b))


def _k_scales_and_mins(blocks: np.ndarray, levels: int) -> tuple:
    """Per sub-block of 32: w ~ d * sc * q - dmin * m with 6-bit sc, m; q in 0..levels."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    mins = np.maximum(0, -sub.min(axis=-1))  # the offset -dmin * m is <= 0
    scales = (sub.max(axis=-1) + mins) / levels
    d = (scales.max(axis=-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (mins.max(axis=-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_safe_div(scales, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_safe_div(mins, dmin[:, None])), 0, 63).astype(np.uint8)
    step = d[:, None] * sc
    q = np.clip(np.rint(_safe_div(sub + (dmin[:, None] * m)[..., None], step[..., None])), 0, levels).astype(np.uint8)
    packed = np.empty((n, 12), dtype=np.uint8)  # the layout gguf's Q4_K.get_scale_min reads
    packed[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    return d, dmin, packed, q


def _low_nibble_runs(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] -> [n, 128]: run j holds sub-block 2j in the low nibbles, 2j + 1 in the high ones."""
    return ((q[:, 0::2] & 0x0F) | ((q[:, 1::2] & 0x0F) << 4)).reshape(q.shape[0], 128)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _k_scales_and_mins(blocks, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, _low_nibble_runs(q)], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _k_scales_and_mins(blocks, 31)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for i in range(8):  # bit i of byte l: the high bit of weight 32 i + l
        qh |= ((q[:, i] >> 4) & 1) << i
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qh, _low_nibble_runs(q)], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    groups = blocks.reshape(n, 16, 16)
    amax = np.abs(groups).max(axis=-1)
    s = amax / 31
    d = (s.max(axis=-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_safe_div(s, d[:, None])), -128, 127).astype(np.int8)
    step = d[:, None] * sc.astype(np.float32)
    q = (np.clip(np.rint(_safe_div(groups, step[..., None])), -32, 31) + 32).astype(np.uint8).reshape(n, 256)
    halves = q.reshape(n, 2, 128)  # weight 128 c + 64 s + e: nibble s of low byte 64 c + e
    ql = ((halves[..., :64] & 0x0F) | ((halves[..., 64:] & 0x0F) << 4)).reshape(n, 128)
    fields = (q >> 4).reshape(n, 2, 4, 32)  # weight 128 c + 32 k + l: bits 2k of high byte 32 c + l
    qh = (fields[:, :, 0] | (fields[:, :, 1] << 2) | (fields[:, :, 2] << 4) | (fields[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)


def _iq4_xs(blocks: np.ndarray) -> np.ndarray:
    """Per sub-block of 32: w ~ d * (ls - 32) * V[i], the scale putting its largest magnitude on V's -127."""
    n = blocks.shape[0]
    values = np.array(quants.IQ4_NL.kvalues, dtype=np.float32)
    sub = blocks.reshape(n, 8, 32)
    peak = np.take_along_axis(sub, np.abs(sub).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    s = -peak / 127
    d = (np.abs(s).max(axis=-1) / 32).astype(np.float16).astype(np.float32)
    ls = (np.clip(np.rint(_safe_div(s, d[:, None])), -32, 31) + 32).astype(np.uint8)
    step = d[:, None] * (ls.astype(np.float32) - 32)
    idx = np.abs(_safe_div(sub, step[..., None])[..., None] - values).argmin(axis=-1).astype(np.uint8)
    scales_h = np.zeros(n, dtype=np.uint16)
    for j in range(8):
        scales_h |= (ls[:, j].astype(np.uint16) >> 4) << (2 * j)
    scales_l = (ls[:, 0::2] & 0x0F) | ((ls[:, 1::2] & 0x0F) << 4)
    qs = (idx[..., :16] | (idx[..., 16:] << 4)).reshape(n, 128)  # sub-block j: bytes 16j.., low then high nibbles
    return np.concatenate([_f16_bytes(d), scales_h.view(np.uint8).reshape(n, 2), scales_l, qs], axis=1)


_K_QUANTIZERS = {T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k, T.IQ4_XS: _iq4_xs}
