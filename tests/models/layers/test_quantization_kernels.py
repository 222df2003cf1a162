"""The weight-only integer matmuls: the same result as the float weight they stand for, on the path vx chose (the C
kernel's int8-activation path where the CPU has VNNI: within x's int8 rounding), on the C kernel's float path and on
the torch fallback (within float rounding), and never through a float copy of the weight."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.quant_matmul import (UNIT_ROUNDOFF, assert_within_int8_rounding, assert_within_rounding, dequantize,
                                        random_groupwise)
from vx.kernels.quant_matmul import load_quant_matmul_kernel
from vx.models.layers.quantization import kernels
from vx.models.layers.quantization.kernels import Int4Groupwise, Int8Groupwise, Int8PerChannel

HAS_C_KERNEL = load_quant_matmul_kernel() is not None
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (N, K, group): odd N, N not a multiple of 16, several groups per row, one group per row; K a multiple of group.
SHAPES = [(33, 64, 32), (40, 128, 64), (7, 256, 128), (48, 96, 32)]
MS = [1, 3, 33]


@pytest.fixture(params=["chosen", "float", "torch"])
def path(request, monkeypatch):
    """Each test runs on the kernel vx chose here, on the C kernel's float path (`VX_CPU_MATMUL=float`), and on the
    torch fallback (as without a C compiler)."""
    monkeypatch.delenv("VX_CPU_MATMUL", raising=False)
    if request.param == "torch":
        monkeypatch.setenv("VX_CPU_KERNELS", "0")
    if request.param == "float":
        monkeypatch.setenv("VX_CPU_MATMUL", "float")
    load_quant_matmul_kernel.cache_clear()
    yield request.param
    monkeypatch.undo()
    load_quant_matmul_kernel.cache_clear()


def _layer(layout: str, n: int, k: int, group: int, dtype: torch.dtype, seed: int):
    """A packed layer in `layout` and the float64 weight it stands for (with the scales as the layer got them)."""
    if layout == "int4":
        q, scale, zero = random_groupwise(n, k, group, 4, seed, dtype)
        return Int4Groupwise(q, scale, zero, group), q, scale, zero, group
    if layout == "int8g":
        q, scale, zero = random_groupwise(n, k, group, 8, seed, dtype)
        return Int8Groupwise(q, scale, zero, group), q, scale, zero, group
    q, scale, _ = random_groupwise(n, k, k, 8, seed, dtype)
    return Int8PerChannel(q, scale[:, 0]), q, scale, torch.zeros_like(scale), k


def _weight_error(layer, q, scale, zero, group, dtype) -> torch.Tensor | None:
    """How far the weights a torch fallback multiplies by may be from the exact ones, by its formula."""
    u = UNIT_ROUNDOFF[dtype]
    if layer.kernel == kernels.VX_CPU:  # dequantized in float32, one rounding per weight
        return None
    n, k = q.shape
    s, z = (t.double().repeat_interleave(group, 1) for t in (scale, zero))
    qd = q.double()
    if layer.kernel == kernels.TORCH_INT4PACK:  # (q - 8) * s + fl(z + 8 s), in x's dtype
        return 2 * u * ((qd - 8).abs() * s.abs() + (z + 8 * s).abs())
    return 2 * u * (qd.abs() * s.abs() + z.abs())  # q * s (+ z) in x's dtype


@pytest.mark.parametrize("layout", ["int4", "int8g", "int8pc"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,group", SHAPES)
def test_matches_its_float_weight(path, layout, dtype, n, k, group):
    layer, q, scale, zero, group = _layer(layout, n, k, group, dtype, seed=n + k)
    if path != "torch" and HAS_C_KERNEL:
        assert layer.kernel == kernels.VX_CPU
    elif path == "torch":
        assert layer.kernel != kernels.VX_CPU
    int8_act = layer.kernel == kernels.VX_CPU and layer._packed.int8_activations
    assert not (int8_act and path == "float")
    w = dequantize(q, scale, zero, group)
    err = _weight_error(layer, q, scale, zero, group, dtype)
    bits = 4 if layout == "int4" else 8

    def check(y: torch.Tensor, x: torch.Tensor) -> None:
        if int8_act:
            assert_within_int8_rounding(y, x, q, scale, zero, group, bits)
        else:
            assert_within_rounding(y, x, w, err)

    gen = torch.Generator().manual_seed(k)
    for m in MS:
        x = torch.randn(m, k, generator=gen).to(dtype)
        check(layer.matmul(x), x)
    x = torch.randn(2, 3, k, generator=gen).to(dtype)  # leading dimensions are kept
    y = layer.matmul(x)
    assert y.shape == (2, 3, n)
    check(y, x)


@pytest.mark.parametrize("layout", ["int4", "int8g", "int8pc"])
def test_packed_bytes(path, layout):
    layer, *_ = _layer(layout, 64, 256, 32, torch.float32, seed=0)
    bits = 4 if layout == "int4" else 8
    # The integers at their width, plus at most a float32 scale and zero per group (and padding to a panel).
    assert 64 * 256 * bits / 8 < layer.nbytes <= (64 * 256 * bits / 8 + 64 * 8 * 8) * 1.5


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any torch op produces while active (the C kernel's own memory is its stack)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("layout", ["int4", "int8g", "int8pc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_float_copy_of_the_weight(path, monkeypatch, layout, dtype):
    """No op inside matmul makes a tensor as large as the weight: the reference that dequantized the whole layer
    per call fails this. The torch fallback's blocks of rows are held to a block smaller than the layer here."""
    monkeypatch.setattr(kernels, "_BLOCK_ELEMENTS", 1024)
    n, k = 64, 256
    layer, *_ = _layer(layout, n, k, 32, dtype, seed=1)
    x = torch.randn(3, k).to(dtype)
    with _LargestTensor() as seen:
        layer.matmul(x)
    assert 0 < seen.numel < n * k // 4


def test_the_reference_would_be_caught():
    """The check above sees a whole-weight dequantization (what Int8Groupwise did before it had a kernel)."""
    q, scale, zero = random_groupwise(64, 256, 32, 8, seed=2)
    with _LargestTensor() as seen:
        torch.nn.functional.linear(torch.randn(3, 256), dequantize(q, scale, zero, 32).float())
    assert seen.numel >= 64 * 256


@pytest.mark.skipif(not HAS_C_KERNEL, reason="the CPU kernel cannot be built here (no C compiler)")
def test_cpu_runs_the_c_kernel_for_every_layout(monkeypatch):
    """Guard against a silent fallback: with every torch path broken, the layers still multiply on the CPU."""
    for name in ("_weight_int4pack_mm_for_cpu", "_weight_int8pack_mm", "_convert_weight_to_int4pack_for_cpu"):
        monkeypatch.setattr(torch.ops.aten, name, None, raising=False)
    monkeypatch.setattr(kernels, "_dequantized_blocks", lambda *a: pytest.fail("fell back"))
    for layout in ("int4", "int8g", "int8pc"):
        layer, q, scale, zero, group = _layer(layout, 24, 64, 32, torch.float32, seed=3)
        assert layer.kernel == kernels.VX_CPU
        x = torch.randn(2, 64)
        if layer._packed.int8_activations:
            assert_within_int8_rounding(layer.matmul(x), x, q, scale, zero, group, 4 if layout == "int4" else 8)
        else:
            assert_within_rounding(layer.matmul(x), x, dequantize(q, scale, zero, group))


def test_refuses_groups_that_do_not_fit():
    with pytest.raises(ValueError, match="do not fit groups of 32"):
        Int4Groupwise(torch.zeros(16, 48, dtype=torch.int64), torch.ones(16, 1), torch.zeros(16, 1), 32)
    with pytest.raises(ValueError, match="do not fit groups of 16"):
        Int8Groupwise(torch.zeros(16, 48, dtype=torch.int8), torch.ones(16, 2), torch.zeros(16, 2), 16)
    with pytest.raises(ValueError, match="not int8"):
        Int8Groupwise(torch.zeros(16, 48, dtype=torch.int32), torch.ones(16, 3), torch.zeros(16, 3), 16)
    with pytest.raises(ValueError, match="Int8PerChannel"):
        Int8PerChannel(torch.zeros(16, 48, dtype=torch.int8), torch.ones(15))


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_channel_blocks_the_cuda_path_takes(monkeypatch, dtype):
    """Int8PerChannel on CUDA multiplies through the blocks of rows (no GPU here: the same function on the CPU)."""
    monkeypatch.setattr(kernels, "_BLOCK_ELEMENTS", 300)
    q, scale, _ = random_groupwise(37, 96, 96, 8, seed=4, dtype=dtype)
    x = torch.randn(5, 96).to(dtype)
    y = kernels._dequantized_blocks(x, q, scale, None, 96)
    qd, s = q.double(), scale.double()
    assert_within_rounding(y, x, qd * s, 2 * UNIT_ROUNDOFF[dtype] * qd.abs() * s.abs())
