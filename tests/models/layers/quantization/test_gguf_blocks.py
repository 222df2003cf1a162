"""GGUF's block layouts unpacked into integers, scales and zeros: the weights `gguf.quants.dequantize` reads from
the same bytes, exactly, for every type vx loads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from tests.support.gguf_quants import quantize, random_blocks

from vx.models.layers.quantization.gguf_blocks import (IQ4_VALUES, QUANTIZED_TYPES, as_float, dequantize,
                                                       row_bytes, row_features, type_name, unpack)

T = GGMLQuantizationType
# (group size, bits, range of q) as the docs state them.
LAYOUT = {T.Q4_0: (32, 4, (0, 15)), T.Q4_1: (32, 4, (0, 15)), T.Q4_K: (32, 4, (0, 15)),
          T.Q5_0: (32, 8, (-16, 15)), T.Q5_1: (32, 8, (0, 31)), T.Q5_K: (32, 8, (0, 31)),
          T.Q8_0: (32, 8, (-128, 127)), T.Q6_K: (16, 8, (-32, 31)), T.IQ4_XS: (32, 8, (-127, 113))}


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES, ids=type_name)
def test_random_blocks_unpack_to_what_gguf_dequantizes(qtype):
    """Random bytes reach every bit of every field; the result is bit for bit gguf's."""
    raw = random_blocks(6, 512, qtype, np.random.default_rng(int(qtype)))
    want = quants.dequantize(raw, qtype)
    got = unpack(torch.from_numpy(raw), qtype)
    group, bits, (lo, hi) = LAYOUT[qtype]
    assert (got.group_size, got.bits) == (group, bits)
    assert got.q.shape == (6, 512) and got.scale.shape == got.zero.shape == (6, 512 // group)
    assert got.q.dtype == (torch.uint8 if bits == 4 else torch.int8)
    assert lo <= got.q.min().item() and got.q.max().item() <= hi
    assert got.q.min().item() == lo and got.q.max().item() == hi  # random bytes reach both ends
    torch.testing.assert_close(got.dequantize(), torch.from_numpy(want), rtol=0, atol=0)


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES, ids=type_name)
def test_quantized_weights_unpack_exactly_and_near_the_floats(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    weights = rng.normal(0, 0.1, (5, 256)).astype(np.float32)
    raw = quantize(weights, qtype)
    got = dequantize(torch.from_numpy(raw), qtype)
    torch.testing.assert_close(got, torch.from_numpy(quants.dequantize(raw, qtype)), rtol=0, atol=0)
    # And the blocks hold the weights (the test quantizer writes valid blocks): within a few quantization steps.
    group, _, (lo, hi) = LAYOUT[qtype]
    step = np.abs(weights).max() * 2 / (hi - lo)
    if qtype == T.IQ4_XS:  # a table of 16 values, not a grid: within its widest gap (of 127 at the largest weight)
        step = np.abs(weights).max() * np.diff(IQ4_VALUES).max() / 127 / 4
    assert np.abs(got.numpy() - weights).max() < 4 * step


def test_only_the_rows_asked_for_are_unpacked():
    raw = quantize(np.random.default_rng(3).normal(0, 1, (8, 64)).astype(np.float32), T.Q4_1)
    rows = torch.from_numpy(raw)[torch.tensor([5, 1, 5])]
    torch.testing.assert_close(dequantize(rows, T.Q4_1),
                               torch.from_numpy(quants.dequantize(raw, T.Q4_1))[[5, 1, 5]], rtol=0, atol=0)


def test_float_rows_are_viewed_as_they_are():
    x = np.random.default_rng(4).normal(0, 1, (3, 8)).astype(np.float16)
    raw = torch.from_numpy(x.view(np.uint8))
    assert as_float(raw, T.F16).dtype == torch.float16
    torch.testing.assert_close(dequantize(raw, T.F16), torch.from_numpy(x.astype(np.float32)), rtol=0, atol=0)


def test_sizes_and_refusals():
    assert row_bytes(T.Q4_K, 512) == 288 and row_features(T.Q4_K, 288) == 512
    assert row_bytes(T.Q8_0, 64) == 68 and row_features(T.F32, 16) == 4
    with pytest.raises(ValueError, match="Q4_K needs rows of a multiple of 256"):
        row_bytes(T.Q4_K, 64)
    with pytest.raises(ValueError, match="GGUF type Q2_K cannot be unpacked"):
        unpack(torch.zeros(1, 84, dtype=torch.uint8), T.Q2_K)
    with pytest.raises(ValueError, match="not a whole number of blocks"):
        unpack(torch.zeros(1, 19, dtype=torch.uint8), T.Q4_0)
    assert type_name(T.IQ4_XS) == "IQ4_XS" and type_name(999) == "type 999"
