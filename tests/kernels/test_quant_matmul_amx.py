"""The AMX path of the weight-only matmuls (csrc/quant_matmul_amx.c): many rows of x times an int8-layout weight
on bf16 tiles. Its products must be within the rounding of x and of each dequantized weight to bfloat16 (and
float32 accumulation) of the exact ones, for every tail of rows and features; and only `VX_CPU_MATMUL=auto`, whole
32-k tiles and enough rows send a product there."""

from __future__ import annotations

import pytest
import torch

from tests.support.quant_matmul import UNIT_ROUNDOFF, assert_within_rounding, dequantize, random_groupwise
from vx.kernels import quant_matmul
from vx.kernels.quant_matmul import AMX_MIN_ROWS, load_quant_matmul_kernel

_KERNEL = load_quant_matmul_kernel()
pytestmark = pytest.mark.skipif(_KERNEL is None or not _KERNEL.has_amx,
                                reason="no AMX bf16 tiles here (CPU, OS or compiler)")


def assert_within_bf16_rounding(y: torch.Tensor, x: torch.Tensor, q, scale, zero, group: int) -> None:
    """x and every weight rounded to bfloat16 once, products summed in float32."""
    w = dequantize(q, scale, zero, group)
    weight_error = UNIT_ROUNDOFF[torch.bfloat16] * (1 + 1e-6) * w.abs()
    assert_within_rounding(y, x.bfloat16().float(), w, weight_error)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group", [(33, 64, 32), (40, 96, 16), (7, 64, 8), (100, 640, 40), (50, 320, 320),
                                       (96, 576, 32)])
@pytest.mark.parametrize("half_scales", [False, True])
def test_amx_path_is_within_bf16_rounding(monkeypatch, bits, n, k, group, half_scales):
    monkeypatch.setenv("VX_CPU_MATMUL", "auto")
    q, scale, zero = random_groupwise(n, k, group, bits, seed=n * k + bits)
    if half_scales:
        scale, zero = scale.half().float(), zero.half().float()
    packed = _KERNEL.pack(q, scale, zero, group, bits)
    assert packed.amx
    gen = torch.Generator().manual_seed(k)
    for m in (AMX_MIN_ROWS, 33, 48, 64, 100):  # whole 32-row blocks, tails of one, 16 and 20 rows
        x = torch.randn(m, k, generator=gen)
        assert _KERNEL.uses_amx(m, packed)
        assert_within_bf16_rounding(_KERNEL.matmul(x, packed), x, q, scale, zero, group)


def test_what_takes_the_amx_path(monkeypatch):
    q, scale, zero = random_groupwise(64, 96, 32, 4, seed=1)
    monkeypatch.setenv("VX_CPU_MATMUL", "auto")
    packed = _KERNEL.pack(q, scale, zero, 32, 4)
    assert packed.amx and not _KERNEL.uses_amx(AMX_MIN_ROWS - 1, packed) and _KERNEL.uses_amx(AMX_MIN_ROWS, packed)
    q80, scale80, zero80 = random_groupwise(64, 80, 16, 4, seed=2)
    assert not _KERNEL.pack(q80, scale80, zero80, 16, 4).amx  # 80 k: no whole tiles
    monkeypatch.setenv("VX_CPU_MATMUL", "int8")  # int8 asks for the int8 rounding at every size
    assert not _KERNEL.pack(q, scale, zero, 32, 4).amx


def test_one_thread_and_the_team_give_the_same_products(monkeypatch):
    monkeypatch.setenv("VX_CPU_MATMUL", "auto")
    q, scale, zero = random_groupwise(200, 96, 32, 8, seed=3)
    packed = _KERNEL.pack(q, scale, zero, 32, 8)
    x = torch.randn(70, 96, generator=torch.Generator().manual_seed(4))
    ys = []
    for threads in (1, 2):
        monkeypatch.setattr(quant_matmul.torch, "get_num_threads", lambda threads=threads: threads)
        ys.append(_KERNEL.matmul(x, packed))
    assert torch.equal(ys[0], ys[1])
