"""The GGUF as-stored matmul (vx/kernels/csrc/gguf_kquant.c) against gguf's own dequantization.

The kernel rounds x to int8 per block of QB values (256 for Q4_K, Q5_K and Q6_K, 32 for the types with a float scale
per 32 weights: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_XS): x[k] becomes
dx * xq[k] with dx = max |x[block]| / 127 and xq = round(x / dx), off by at most dx / 2 = max |x[block]| / 254.
So against the float32 reference x @ W^T (W from gguf.quants.dequantize) a product may be off by
    sum over blocks b of (max |x[m, b]| / 254) * sum_{k in b} |W[n, k]|
plus float32 rounding; a wrong weight, scale or block is off by the size of the product itself. The same rounding of
x done here in torch gives x_hat, and the kernel must equal x_hat @ W^T up to float32 rounding alone.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from benchmarks.gguf_matmul import random_blocks  # random bytes, small finite float16 scales: valid blocks
from vx.kernels.gguf_matmul import load_gguf_matmul_kernel
from vx.models.layers.quantization.gguf_blocks import unpack

T = GGMLQuantizationType
_ACT_BLOCK = {T.Q4_0: 32, T.Q4_1: 32, T.Q5_0: 32, T.Q5_1: 32, T.Q8_0: 32, T.IQ4_XS: 32, T.Q4_K: 256, T.Q5_K: 256,
              T.Q6_K: 256}
# Float32 rounding of the per-block products and their sum, relative to the sum of the terms' magnitudes (a few
# roundings per block; the blocks here are few): far below an int8 step and far below a wrong weight.
_FLOAT_SLACK = 64 * 2.0**-24


def round_like_kernel(x: torch.Tensor, qb: int) -> torch.Tensor:
    """x rounded to int8 per block of qb as the kernel rounds it (float32 arithmetic, ties to even), as floats."""
    xb = x.view(x.shape[0], -1, qb)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return (torch.round(xb * inv) * (amax / 127.0)).view_as(x)


def int8_bound(x: torch.Tensor, w: torch.Tensor, qb: int) -> torch.Tensor:
    """[M, N]: sum over x's blocks of max |x[block]| / 254 times the block's sum of |W[n, k]| (see the module)."""
    step = x.view(x.shape[0], -1, qb).abs().amax(dim=-1).double() / 254  # [M, blocks]
    wsum = w.double().abs().view(w.shape[0], -1, qb).sum(dim=-1)  # [N, blocks]
    return step @ wsum.T


def magnitude(x: torch.Tensor, raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """[M, N]: |x| times the magnitudes of the terms the kernel sums (q * scale, a weight's offset and minimum)."""
    g = unpack(raw, ggml_type)
    n, k = g.q.shape
    groups = g.q.double().abs().view(n, -1, g.group_size) + 64  # 64: more than any offset taken off q
    terms = (groups * g.scale.double().abs()[..., None] + g.zero.double().abs()[..., None]).view(n, k)
    return x.double().abs() @ terms.T


def check(kernel, ggml_type: int, m: int, n: int, k: int, seed: int, threads: int | None = None,
          rows: bool = False) -> None:
    """kernel.matmul (or with `rows`, kernel.matmul_rows) against the reference and against x rounded alike."""
    raw = random_blocks(ggml_type, n, k, seed)
    w = torch.from_numpy(gguf_dequantize(raw.numpy(), ggml_type)).view(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1))
    y = (kernel.matmul_rows if rows else kernel.matmul)(x, raw, ggml_type, threads=threads)
    assert y.shape == (m, n) and y.dtype == torch.float32
    qb = _ACT_BLOCK[ggml_type]
    # Against the reference: within the int8 rounding bound (plus float32 rounding).
    ref = x @ w.T
    err = (y.double() - ref.double()).abs()
    bound = int8_bound(x, w, qb) + _FLOAT_SLACK * magnitude(x, raw, ggml_type)
    assert (err <= bound).all(), f"error {err.max():.3e} above the int8 bound (worst excess {(err - bound).max():.3e})"
    # Against x rounded the same way: float32 rounding alone, so the bound above is not hiding a wrong term.
    exact = round_like_kernel(x, qb).double() @ w.double().T
    err = (y.double() - exact).abs()
    assert (err <= _FLOAT_SLACK * magnitude(x, raw, ggml_type)).all(), f"error {err.max():.3e} beyond float rounding"


_TYPES = [T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_0, T.Q5_K, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_XS]


def _k_for(ggml_type: int, blocks: int) -> int:
    return GGML_QUANT_SIZES[T(ggml_type)][0] * blocks


@pytest.fixture(scope="module", params=[(True, True), (True, False), (False, True)], ids=["native", "256-bit", "avx2"])
def kernel(request):
    """Every build: the CPU's (VNNI, and 512-bit Q4_K / Q6_K, where it has them), the CPU's with 256-bit code only,
    and an AVX2-only one (no AVX-512, no VNNI)."""
    vnni, wide = request.param
    k = load_gguf_matmul_kernel(vnni=vnni, wide=wide)
    if k is None or not k.types:
        pytest.skip("the GGUF matmul kernel does not build here (no compiler or no AVX2)")
    return k


@pytest.mark.parametrize("ggml_type", _TYPES, ids=lambda t: T(t).name)
@pytest.mark.parametrize("m", [1, 6])
def test_matches_gguf_dequantize(kernel, ggml_type: int, m: int) -> None:
    check(kernel, ggml_type, m, n=37, k=_k_for(ggml_type, 3), seed=int(ggml_type) * 10 + m)


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_1], ids=lambda t: T(t).name)
def test_two_threads_odd_rows(kernel, ggml_type: int) -> None:
    """Rows that do not split evenly over the threads, and rows of x in a tile of 4 plus a rest."""
    check(kernel, ggml_type, m=7, n=19, k=_k_for(ggml_type, 2), seed=5, threads=2)


def test_many_rows_span_chunks(kernel) -> None:
    """More rows of x than one cache chunk holds (512 KiB of int8 x / K): chunk boundaries are seamless."""
    k = _k_for(T.Q4_K, 16)  # 4096: chunks of 128 rows
    check(kernel, T.Q4_K, m=131, n=5, k=k, seed=9)


def test_vnni_flag_and_types() -> None:
    """The AVX2-only build says it has no VNNI, and both serve the nine types."""
    plain = load_gguf_matmul_kernel(vnni=False)
    if plain is None:
        pytest.skip("the GGUF matmul kernel does not build here")
    assert not plain.vnni
    assert set(_TYPES) <= plain.types or not plain.types


def test_rejects_a_type_it_does_not_serve() -> None:
    k = load_gguf_matmul_kernel()
    if k is None or not k.types:
        pytest.skip("the GGUF matmul kernel does not build here")
    with pytest.raises(ValueError):
        k.matmul(torch.zeros(1, 256), torch.zeros(2, 84, dtype=torch.uint8), int(T.Q2_K))
    with pytest.raises(ValueError):  # rows of another width than x's
        k.matmul(torch.zeros(1, 256), torch.zeros(2, 2 * 144, dtype=torch.uint8), int(T.Q4_K))


@pytest.fixture(scope="module")
def rows_kernel():
    """The CPU's build where it has the several-rows kernel (csrc/gguf_rows.c: AVX-512 VNNI)."""
    k = load_gguf_matmul_kernel()
    if k is None or not k.rows_types:
        pytest.skip("no several-rows kernel here (it needs AVX-512 VNNI)")
    return k


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K], ids=lambda t: T(t).name)
def test_rows_kernel_matches_gguf_dequantize(rows_kernel, ggml_type: int) -> None:
    """Several rows through 16-row panels: a tile of 8 rows and a rest, a last panel of 5 weight rows, two threads;
    x rounded per block of 256 as the as-stored kernel rounds it."""
    check(rows_kernel, ggml_type, m=11, n=37, k=_k_for(ggml_type, 3), seed=int(ggml_type) + 40, threads=2, rows=True)


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K], ids=lambda t: T(t).name)
def test_rows_kernel_row_depends_on_that_row_alone(rows_kernel, ggml_type: int) -> None:
    """A row's product is the same bits whatever the other rows, their order, their count (tiles, and chunks of x
    past 128 rows at K 4096) and the threads: compiled decode graphs pad a batch with rows of their own."""
    n, k = 21, _k_for(ggml_type, 16)
    raw = random_blocks(ggml_type, n, k, seed=8)
    x = torch.randn(131, k, generator=torch.Generator().manual_seed(9))
    y = rows_kernel.matmul_rows(x, raw, ggml_type, threads=2)
    pick = torch.tensor([130, 0, 128, 127, 5])
    assert torch.equal(rows_kernel.matmul_rows(x[pick], raw, ggml_type, threads=1), y[pick])
    assert torch.equal(rows_kernel.matmul_rows(x[7:8], raw, ggml_type, threads=1), y[7:8])


def test_product_takes_the_rows_kernel_from_rows_from_on(rows_kernel) -> None:
    from vx.kernels.gguf_matmul import ROWS_FROM

    raw = random_blocks(T.Q6_K, 20, 256, seed=10)
    x = torch.randn(ROWS_FROM, 256, generator=torch.Generator().manual_seed(11))
    assert torch.equal(rows_kernel.product(x, raw, T.Q6_K), rows_kernel.matmul_rows(x, raw, T.Q6_K))
    few = x[:ROWS_FROM - 1]
    assert torch.equal(rows_kernel.product(few, raw, T.Q6_K), rows_kernel.matmul(few, raw, T.Q6_K))


@pytest.mark.parametrize("ggml_type", _TYPES, ids=lambda t: T(t).name)
def test_many_rows_through_decoded_panels(ggml_type: int, monkeypatch) -> None:
    """The many-row way: chunks decoded into the int8 kernel's panels (csrc/gguf_panels.c), x rounded per group of
    the weight (32, 16 for Q6_K) as that kernel rounds it: within that rounding's bound of the reference, and the
    same product as the weight repacked at load (`unpack`'s integers through `pack`)."""
    from vx.kernels import gguf_matmul
    from vx.kernels.quant_matmul import load_quant_matmul_kernel

    kernel, repacked = load_gguf_matmul_kernel(), load_quant_matmul_kernel()
    if kernel is None or not kernel.many_rows_serves(ggml_type, repacked):
        pytest.skip("no panel decoder or int8 kernel for this type here")
    n, k, m = 37, _k_for(ggml_type, 3), 5
    raw = random_blocks(ggml_type, n, k, seed=3)
    w = torch.from_numpy(gguf_dequantize(raw.numpy(), ggml_type)).view(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4))
    # Chunks of one panel each: several chunks, and a padded last panel.
    monkeypatch.setattr(gguf_matmul, "_PANEL_CHUNK_BYTES", 1)
    y = kernel.matmul_many_rows(x, raw, ggml_type, repacked)
    _, group = kernel.panel_format(ggml_type)
    err = (y.double() - (x @ w.T).double()).abs()
    bound = int8_bound(x, w, group) + _FLOAT_SLACK * magnitude(x, raw, ggml_type)
    assert (err <= bound).all(), f"error {err.max():.3e} above the int8 bound"
    monkeypatch.setenv("VX_CPU_MATMUL", "int8")
    g = unpack(raw, ggml_type)
    packed = repacked.pack(g.q, g.scale, g.zero, g.group_size, g.bits)
    assert torch.allclose(y, repacked.matmul(x, packed, amx=False), rtol=0, atol=1e-5 * y.abs().max().item())


def test_product_takes_the_panels_from_many_rows_on() -> None:
    from vx.kernels.gguf_matmul import many_rows
    from vx.kernels.quant_matmul import load_quant_matmul_kernel

    kernel, repacked = load_gguf_matmul_kernel(), load_quant_matmul_kernel()
    if kernel is None or not kernel.many_rows_serves(T.Q4_0, repacked):
        pytest.skip("no panel decoder or int8 kernel here")
    raw = random_blocks(T.Q4_0, 20, 256, seed=6)  # a type the several-rows kernel does not take
    rows = many_rows(T.Q4_0)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(7))
    assert torch.equal(kernel.product(x, raw, T.Q4_0), kernel.matmul_many_rows(x, raw, T.Q4_0, repacked))
    few = x[:rows - 1]
    assert torch.equal(kernel.product(few, raw, T.Q4_0), kernel.matmul(few, raw, T.Q4_0))
