"""The int8-activation path of the weight-only matmuls (csrc/quant_matmul_i8.c): x rounded to int8 per (row, group)
and integer dot products. Its products must be within x's int8 rounding of the exact ones (the bound is derived in
tests/support/quant_matmul.py), at every vector width and dot product it builds for (512-bit VNNI, 256-bit VNNI,
AVX2's maddubs as on a CPU without VNNI), every tile of rows and partial panel; and `VX_CPU_MATMUL` and the CPU
decide which path a weight gets."""

from __future__ import annotations

import pytest
import torch

from tests.support.quant_matmul import (assert_within_int8_rounding, assert_within_rounding, dequantize,
                                        random_groupwise)
from vx.kernels.quant_matmul import load_quant_matmul_kernel
from vx.platform import cpu_flags

pytestmark = pytest.mark.skipif(load_quant_matmul_kernel() is None,
                                reason="the CPU kernel cannot be built here (no C compiler)")

# (vector bytes, VNNI): the CPU's own build, the 256-bit layout, and the 256-bit one built without VNNI (maddubs)
BUILDS = [(None, True), (32, True), (32, False)]


@pytest.mark.parametrize("vector_bytes,vnni", BUILDS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group", [(33, 64, 32), (40, 96, 16), (7, 48, 8), (17, 640, 40), (50, 320, 320),
                                       (96, 576, 32)])
@pytest.mark.parametrize("half_scales", [False, True])
def test_int8_path_is_within_the_rounding_of_x(monkeypatch, vector_bytes, vnni, bits, n, k, group, half_scales):
    monkeypatch.setenv("VX_CPU_MATMUL", "int8")
    kernel = load_quant_matmul_kernel(vector_bytes, vnni)
    if bits not in kernel.i8_bits:
        pytest.skip(f"this build's int8 path does not serve {bits}-bit weights")
    q, scale, zero = random_groupwise(n, k, group, bits, seed=n * k + bits)
    if half_scales:
        scale, zero = scale.half().float(), zero.half().float()
    packed = kernel.pack(q, scale, zero, group, bits)
    assert packed.int8_activations and packed.sz.dtype == (torch.float16 if half_scales else torch.float32)
    gen = torch.Generator().manual_seed(k)
    for m in (1, 3, 12, 17, 64):  # one row, a tail, a tile and a tail, tiles
        x = torch.randn(m, k, generator=gen)
        x[0, :group] *= 50  # one group of a row far larger than the rest: its own step, the others unharmed
        assert_within_int8_rounding(kernel.matmul(x, packed), x, q, scale, zero, group, bits)


@pytest.mark.parametrize("vector_bytes,vnni", BUILDS)
@pytest.mark.parametrize("bits", [4, 8])
def test_rows_read_back_out_of_the_int8_layout(monkeypatch, vector_bytes, vnni, bits):
    """The int8 layout (four k per lane, nibble pairs at 4 bits) gives a tied embedding's rows back exactly."""
    monkeypatch.setenv("VX_CPU_MATMUL", "int8")
    kernel = load_quant_matmul_kernel(vector_bytes, vnni)
    if bits not in kernel.i8_bits:
        pytest.skip(f"this build's int8 path does not serve {bits}-bit weights")
    n, k, group = 37, 96, 32
    q, scale, zero = random_groupwise(n, k, group, bits, seed=bits)
    packed = kernel.pack(q, scale, zero, group, bits)
    assert packed.int8_activations
    rows = torch.tensor([0, n - 1, 5, 5, 15, 16, 31, 32])
    want = (q.float().view(n, -1, group) * scale[..., None] + zero[..., None]).view(n, k)[rows]
    assert torch.equal(packed.dequantize_rows(rows), want)


@pytest.mark.parametrize("bits", [4, 8])
def test_zero_groups_and_extreme_codes(monkeypatch, bits):
    """A group of x that is all zeros (step 0) gives exact zeros, and the extreme codes (0 and 15, or -128 and
    127, against x at +-127 steps) neither overflow nor saturate."""
    monkeypatch.setenv("VX_CPU_MATMUL", "int8")
    kernel = load_quant_matmul_kernel()
    if bits not in kernel.i8_bits:
        pytest.skip(f"this build's int8 path does not serve {bits}-bit weights")
    n, k, group = 20, 64, 32
    lo, hi = (0, 15) if bits == 4 else (-128, 127)
    q = torch.tensor([lo, hi] * (n * k // 2), dtype=torch.uint8 if bits == 4 else torch.int8).view(n, k)
    scale, zero = torch.full((n, k // group), 0.5), torch.full((n, k // group), -1.0)
    packed = kernel.pack(q, scale, zero, group, bits)
    x = torch.cat([torch.zeros(1, group), torch.tensor([[-3.0, 3.0] * (group // 2)])], dim=1)
    x = torch.cat([x, -x, torch.zeros(1, k)])
    assert torch.equal(kernel.matmul(x, packed), x @ dequantize(q, scale, zero, group).float().T)


def test_one_thread_and_the_team_give_the_same_products(monkeypatch):
    from vx.kernels import quant_matmul

    monkeypatch.setenv("VX_CPU_MATMUL", "int8")
    kernel = load_quant_matmul_kernel()
    if 4 not in kernel.i8_bits:
        pytest.skip("no int8 path here")
    q, scale, zero = random_groupwise(200, 96, 32, 4, seed=3)
    packed = kernel.pack(q, scale, zero, 32, 4)
    for m in (1, 3, 20):
        x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
        ys = []
        for threads in (1, 2):
            monkeypatch.setattr(quant_matmul, "threads_for", lambda serial_us, threads=threads: threads)
            ys.append(kernel.matmul(x, packed))
        assert torch.equal(ys[0], ys[1])


def test_auto_takes_the_int8_path_exactly_where_the_cpu_has_vnni(monkeypatch):
    monkeypatch.delenv("VX_CPU_MATMUL", raising=False)
    q, scale, zero = random_groupwise(24, 64, 32, 4, seed=4)
    kernel = load_quant_matmul_kernel()
    has_vnni = bool({"avx512_vnni", "avx_vnni"} & set(cpu_flags()))
    assert kernel.i8_vnni == has_vnni
    assert kernel.pack(q, scale, zero, 32, 4).int8_activations == has_vnni
    no_vnni = load_quant_matmul_kernel(32, vnni=False)  # as on a CPU without VNNI
    assert not no_vnni.i8_vnni and not no_vnni.pack(q, scale, zero, 32, 4).int8_activations


def test_float_forces_the_exact_path_and_int8_needs_whole_quad_pairs(monkeypatch):
    """`VX_CPU_MATMUL=float` gives the float path (within float rounding of the exact product, which the int8 path
    is not); a group size that is not a multiple of 8, or a bit width the build's int8 path lacks, keeps the float
    path even when int8 is asked for."""
    q, scale, zero = random_groupwise(24, 96, 32, 4, seed=5)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(5))
    w = dequantize(q, scale, zero, 32)
    kernel = load_quant_matmul_kernel()
    monkeypatch.setenv("VX_CPU_MATMUL", "float")
    packed = kernel.pack(q, scale, zero, 32, 4)
    assert not packed.int8_activations
    assert_within_rounding(kernel.matmul(x, packed), x, w)
    monkeypatch.setenv("VX_CPU_MATMUL", "int8")
    if 4 in kernel.i8_bits:
        with pytest.raises(AssertionError, match="above its bound"):
            assert_within_rounding(kernel.matmul(x, kernel.pack(q, scale, zero, 32, 4)), x, w)
    q12, scale12, zero12 = random_groupwise(24, 96, 12, 4, seed=6)
    assert not kernel.pack(q12, scale12, zero12, 12, 4).int8_activations
    q8, scale8, zero8 = random_groupwise(24, 96, 32, 8, seed=7)
    assert not load_quant_matmul_kernel(32, vnni=False).pack(q8, scale8, zero8, 32, 8).int8_activations


def test_an_unknown_mode_is_refused(monkeypatch):
    monkeypatch.setenv("VX_CPU_MATMUL", "fast")
    q, scale, zero = random_groupwise(24, 64, 32, 4, seed=8)
    with pytest.raises(ValueError, match="VX_CPU_MATMUL"):
        load_quant_matmul_kernel().pack(q, scale, zero, 32, 4)


def test_no_rows(monkeypatch):
    monkeypatch.setenv("VX_CPU_MATMUL", "int8")
    kernel = load_quant_matmul_kernel()
    if 4 not in kernel.i8_bits:
        pytest.skip("no int8 path here")
    q, scale, zero = random_groupwise(20, 64, 32, 4, seed=9)
    assert kernel.matmul(torch.zeros(0, 64), kernel.pack(q, scale, zero, 32, 4)).shape == (0, 20)
