"""The weight-only integer matmuls: the same result as the float weight they stand for."""

from __future__ import annotations

import pytest
import torch

from vx.models.layers.quantization.kernels import Int4Groupwise, Int8Groupwise, Int8PerChannel


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("n,k,group", [(64, 64, 32), (40, 128, 64), (48, 256, 128)])
def test_int4_groupwise_matches_its_float_weight(n, k, group, dtype, tol):
    g = torch.Generator().manual_seed(n + k)
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = torch.rand(n, k // group, generator=g) * 0.1 + 0.01
    zero = torch.randn(n, k // group, generator=g) * 0.1
    weight = q.float() * scale.repeat_interleave(group, 1) + zero.repeat_interleave(group, 1)
    packed = Int4Groupwise(q, scale.to(dtype), zero.to(dtype), group)
    x = torch.randn(3, 2, k, generator=g)
    y = packed.matmul(x.to(dtype))
    assert y.shape == (3, 2, n) and y.dtype == dtype
    ref = x @ weight.T
    assert (y.float() - ref).abs().max().item() <= tol * ref.abs().max().item()
    assert packed.nbytes < weight.numel()  # about half a byte a weight, plus the groups' scales


def test_int4_groupwise_refuses_groups_that_do_not_fit():
    with pytest.raises(ValueError, match="do not fit groups of 32"):
        Int4Groupwise(torch.zeros(16, 48, dtype=torch.int64), torch.ones(16, 1), torch.zeros(16, 1), 32)


def test_int8_per_channel_matches_its_float_weight():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-128, 128, (40, 96), generator=g, dtype=torch.int8)
    scale = torch.rand(40, generator=g) * 0.01
    x = torch.randn(5, 96, generator=g)
    torch.testing.assert_close(Int8PerChannel(q, scale).matmul(x), x @ (q.float() * scale[:, None]).T,
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("group", [16, 32])
def test_int8_groupwise_matches_its_float_weight(group):
    g = torch.Generator().manual_seed(group)
    q = torch.randint(-128, 128, (40, 96), generator=g, dtype=torch.int8)
    scale = torch.rand(40, 96 // group, generator=g) * 0.01
    zero = torch.randn(40, 96 // group, generator=g) * 0.01
    weight = q.float() * scale.repeat_interleave(group, 1) + zero.repeat_interleave(group, 1)
    x = torch.randn(5, 96, generator=g)
    torch.testing.assert_close(Int8Groupwise(q, scale, zero, group).matmul(x), x @ weight.T, rtol=1e-4, atol=1e-4)
