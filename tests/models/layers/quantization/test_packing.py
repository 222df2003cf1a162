"""Unpacking int32 words as AWQ and GPTQ pack them, and the groupwise kernels built from codes, scales and zeros."""

from __future__ import annotations

import pytest
import torch

from tests.support.quantized_checkpoints import AWQ_ORDER, pack_along
from vx.models.layers.quantization.packing import int4_groupwise, int8_groupwise, unpack_int32


@pytest.mark.parametrize("bits, dim, order", [(4, 0, None), (4, 1, None), (4, 1, AWQ_ORDER), (8, 0, None),
                                              (8, 1, None)])
def test_unpack_reads_back_what_the_formats_pack(bits, dim, order):
    g = torch.Generator().manual_seed(bits + dim)
    shape = [16, 24]
    shape[dim] = 32
    codes = torch.randint(0, 2**bits, shape, generator=g)
    packed = pack_along(codes, bits, dim, order)
    assert packed.dtype == torch.int32 and packed.shape[dim] == 32 * bits // 32
    torch.testing.assert_close(unpack_int32(packed, bits, dim, order), codes.to(torch.int32))


def test_awq_order_puts_features_in_interleaved_slots():
    # One word holding features 0..7 with codes 0..7: slot i (bits 4i..4i+3) holds feature AWQ_ORDER[i].
    word = int(pack_along(torch.arange(8).reshape(1, 8), 4, 1, AWQ_ORDER)[0, 0])
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]
    torch.testing.assert_close(unpack_int32(torch.tensor([[word]], dtype=torch.int32), 4, 1, AWQ_ORDER),
                               torch.arange(8, dtype=torch.int32).reshape(1, 8))
    with pytest.raises(ValueError, match="not a permutation"):
        unpack_int32(torch.tensor([[word]], dtype=torch.int32), 4, 1, (0, 0, 1, 2, 3, 4, 5, 6))


@pytest.mark.parametrize("group", [32, 64, 128, 96, 256, 512])
def test_int4_groupwise_is_the_affine_weight_for_any_multiple_of_32(group):
    """Groups the kernel does not take (96, 512) repeat their scale over its groups: the same weights."""
    g = torch.Generator().manual_seed(group)
    n, k = 24, 1536
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = torch.rand(n, k // group, generator=g) * 0.1
    zero = torch.randn(n, k // group, generator=g) * 0.1
    weight = q * scale.repeat_interleave(group, 1) + zero.repeat_interleave(group, 1)
    x = torch.randn(3, k, generator=g)
    y = int4_groupwise(q, scale, zero, group, torch.float32).matmul(x)
    torch.testing.assert_close(y, x @ weight.T, rtol=1e-4, atol=1e-4)


def test_int4_groupwise_refuses_groups_no_kernel_takes():
    with pytest.raises(ValueError, match="Groups of 16 input features cannot run on the 4-bit kernel"):
        int4_groupwise(torch.zeros(16, 64, dtype=torch.int64), torch.ones(16, 4), torch.zeros(16, 4), 16,
                       torch.float32)


def test_int8_groupwise_takes_unsigned_codes():
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 256, (8, 64), generator=g)
    scale, zero = torch.rand(8, 2, generator=g) * 0.01, torch.randn(8, 2, generator=g) * 0.01
    weight = q * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    x = torch.randn(2, 64, generator=g)
    torch.testing.assert_close(int8_groupwise(q, scale, zero, 32, torch.float32).matmul(x), x @ weight.T,
                               rtol=1e-4, atol=1e-4)
