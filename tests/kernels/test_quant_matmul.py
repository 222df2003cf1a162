"""The C kernel of the weight-only matmuls at every vector width it builds for (the AVX-512 layout too, on any
x86 machine: GCC splits the wide vectors), on every code path: few rows (dequantized in registers), many rows
(dequantized k-tiles, K beyond one tile, every tail of rows), partial output panels and odd group sizes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.support.quant_matmul import assert_within_rounding, dequantize, random_groupwise
from vx.kernels.quant_matmul import load_quant_matmul_kernel

pytestmark = pytest.mark.skipif(load_quant_matmul_kernel() is None,
                                reason="the CPU kernel cannot be built here (no C compiler)")

WIDTHS = [None, 16, 32, 64]  # the CPU's own, then SSE/NEON-sized, AVX2-sized and AVX-512-sized vectors


@pytest.fixture(autouse=True)
def float_path(monkeypatch):
    """This file checks the float path (exact up to float rounding); test_quant_matmul_i8.py the int8 one."""
    monkeypatch.setenv("VX_CPU_MATMUL", "float")


@pytest.mark.parametrize("vector_bytes", WIDTHS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group", [(33, 64, 32), (40, 96, 16), (7, 48, 3), (17, 600, 40), (50, 320, 320)])
@pytest.mark.parametrize("half_scales", [False, True])
def test_every_path_matches_the_float_weight(vector_bytes, bits, n, k, group, half_scales):
    """Scales and zeros that are float16 values are packed in float16 (others stay float32), same products."""
    kernel = load_quant_matmul_kernel(vector_bytes)
    q, scale, zero = random_groupwise(n, k, group, bits, seed=n * k + bits)
    if half_scales:
        scale, zero = scale.half().float(), zero.half().float()
    packed = kernel.pack(q, scale, zero, group, bits)
    assert packed.sz.dtype == (torch.float16 if half_scales else torch.float32)
    w = dequantize(q, scale, zero, group)
    gen = torch.Generator().manual_seed(k)
    for m in (1, 2, 3, 4, 5, 8, 9, 13, 25):  # few rows, then tiles of 6 (12 wide) and every tail
        x = torch.randn(m, k, generator=gen)
        assert_within_rounding(kernel.matmul(x, packed), x, w)


@pytest.mark.parametrize("vector_bytes", WIDTHS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("half_scales", [False, True])
def test_rows_read_back_out_of_the_packed_weight(vector_bytes, bits, half_scales):
    """A tied token embedding looks its rows up in the head's packed weight: exactly q * scale + zero in float32,
    from every lane of a panel, the partial last panel too, repeated rows as asked."""
    kernel = load_quant_matmul_kernel(vector_bytes)
    n, k, group = 37, 96, 32
    q, scale, zero = random_groupwise(n, k, group, bits, seed=bits)
    if half_scales:
        scale, zero = scale.half().float(), zero.half().float()
    rows = torch.tensor([0, n - 1, 5, 5, 7, 8, 15, 16, 31, 32])
    want = (q.float().view(n, -1, group) * scale[..., None] + zero[..., None]).view(n, k)[rows]
    assert torch.equal(kernel.pack(q, scale, zero, group, bits).dequantize_rows(rows), want)


@pytest.mark.parametrize("bits", [4, 8])
def test_one_thread_and_the_team_give_the_same_products(monkeypatch, bits):
    """Small calls run on the calling thread alone (`vx.kernels.threads`), large ones split panels over threads."""
    from vx.kernels import quant_matmul

    kernel = load_quant_matmul_kernel()
    q, scale, zero = random_groupwise(200, 96, 32, bits, seed=3)
    packed = kernel.pack(q, scale, zero, 32, bits)
    for m in (1, 3, 20):
        x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
        ys = []
        for threads in (1, 2):
            monkeypatch.setattr(quant_matmul, "threads_for", lambda serial_us, threads=threads: threads)
            ys.append(kernel.matmul(x, packed))
        assert torch.equal(ys[0], ys[1])


@pytest.mark.parametrize("vector_bytes", WIDTHS)
def test_panels_have_the_vector_width(vector_bytes):
    kernel = load_quant_matmul_kernel(vector_bytes)
    if vector_bytes is not None:
        assert kernel.panel == 2 * vector_bytes // 4
    q, scale, zero = random_groupwise(3, 64, 32, 4, seed=0)
    packed = kernel.pack(q, scale, zero, 32, 4)
    # Whole panels of half-byte weights, then each panel's groups: scales and zeros of every padded feature.
    assert packed.q.shape == (1, 64, kernel.panel // 2) and packed.sz.shape == (1, 2, 2, kernel.panel)


def test_no_rows_and_bad_inputs():
    kernel = load_quant_matmul_kernel()
    q, scale, zero = random_groupwise(20, 64, 32, 8, seed=1)
    packed = kernel.pack(q, scale, zero, 32, 8)
    assert kernel.matmul(torch.zeros(0, 64), packed).shape == (0, 20)
    with pytest.raises(ValueError, match="for a weight of 64 inputs"):
        kernel.matmul(torch.zeros(2, 63), packed)
    with pytest.raises(ValueError, match="float32"):
        kernel.matmul(torch.zeros(2, 64, dtype=torch.bfloat16), packed)
    with pytest.raises(ValueError, match="groups of 24"):
        kernel.pack(q, scale, zero, 24, 8)
    with pytest.raises(ValueError, match="3-bit"):
        kernel.pack(q, scale, zero, 32, 3)


def test_x_with_strides_is_read_as_its_values():
    kernel = load_quant_matmul_kernel()
    q, scale, zero = random_groupwise(24, 64, 32, 4, seed=2)
    packed = kernel.pack(q, scale, zero, 32, 4)
    x = torch.randn(64, 5).T  # not contiguous
    assert_within_rounding(kernel.matmul(x, packed), x, dequantize(q, scale, zero, 32))


def test_loading_the_kernel_keeps_subnormal_floats():
    """No flush-to-zero switched on for the whole process when the library loads (see vx/kernels/build.py)."""
    code = ("import torch; from vx.kernels.quant_matmul import load_quant_matmul_kernel as k; "
            "assert k() is not None; print((torch.tensor([1e-30]) * torch.tensor([1e-10])).item())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert float(out) > 0.0
