"""The CPU backend's C decode kernel: equal to the torch backend at real model shapes (the specialised head
sizes, GQA groups, long contexts, sliding windows, query rows sliced out of a fused projection), on float32 and
quantized (fp8_e4m3, int8) caches, its fallbacks, and how it is built and selected."""

from __future__ import annotations

import random

import pytest
import torch

from vx.gpu.attention import get_attn_backend
from vx.gpu.attention.cpu_backend import CpuAttentionBackend
from vx.gpu.attention.torch_backend import TorchAttentionBackend
from vx.gpu.attention.backend import CommonAttentionMetadata
from vx.gpu.attention.cpu_kernels import load_paged_decode_kernel, register_paged_decode_op
from vx.gpu.attention.kv_format import kv_cache_format

pytestmark = pytest.mark.skipif(load_paged_decode_kernel() is None,
                                reason="the CPU kernel cannot be built here (no C compiler)")


def _decode_batch(seq_lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int, seed: int = 0,
                  kv_cache_dtype: str = "auto"):
    """A decode-only step: a random cache (stored as kv_cache_dtype says), shuffled block tables, and q as a column
    slice of a wider qkv."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per) + 1
    pool = list(range(1, num_blocks))
    random.Random(seed).shuffle(pool)
    width = max(blocks_per)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for i, nb in enumerate(blocks_per):
        table[i, :nb] = torch.tensor([pool.pop() for _ in range(nb)], dtype=torch.int32)
    cache = torch.randn(TorchAttentionBackend.get_kv_cache_shape(num_blocks, block_size, kv_heads, head_dim),
                        generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    last = lens.long() - 1
    slots = table.long()[torch.arange(len(seq_lens)), last // block_size] * block_size + last % block_size
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=lens, seq_lens_cpu=lens, block_table=table,
        slot_mapping=slots, num_reqs=len(seq_lens), num_actual_tokens=len(seq_lens), max_query_len=1,
        max_seq_len=max(seq_lens), block_size=block_size)
    qkv = torch.randn(len(seq_lens), (heads + 2 * kv_heads) * head_dim, generator=gen)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    fmt = kv_cache_format(kv_cache_dtype)
    return common, fmt.store(cache, fmt.cache_dtype(cache.dtype)), q, k, v


KV_CACHE_DTYPES = ["auto", "fp8_e4m3", "int8"]


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32), (14, 2, 64)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_kernel_equals_torch_backend(heads, kv_heads, head_dim, block_size, window, kv_cache_dtype):
    seq_lens = [1, 2, 17, 300, 511, 64, 33, 130]
    common, cache, q, k, v = _decode_batch(seq_lens, heads, kv_heads, head_dim, block_size,
                                           kv_cache_dtype=kv_cache_dtype)
    assert not q.is_contiguous()  # the kernel reads rows with q's own stride
    outs = []
    for backend in (TorchAttentionBackend, CpuAttentionBackend):
        impl = backend.get_impl_cls()(heads, head_dim, head_dim ** -0.5, kv_heads, sliding_window=window,
                                      kv_cache_dtype=kv_cache_dtype)
        outs.append(impl.forward(None, q, k, v, cache.clone(), backend.build_metadata(common)))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_kernel_gives_the_same_on_one_thread_and_on_the_team(monkeypatch, kv_cache_dtype):
    """Small calls run on the calling thread alone, large ones on the OpenMP team: the same outputs either way."""
    from vx.gpu.attention import cpu_kernels

    common, cache, q, k, v = _decode_batch([1, 17, 300, 64, 130], 9, 3, 64, 16, kv_cache_dtype=kv_cache_dtype)
    impl = CpuAttentionBackend.get_impl_cls()(9, 64, 0.125, 3, kv_cache_dtype=kv_cache_dtype)
    outs = []
    for min_work in (2**62, 0):
        monkeypatch.setattr(cpu_kernels, "_min_parallel_work", lambda: min_work)
        outs.append(impl.forward(None, q, k, v, cache.clone(), CpuAttentionBackend.build_metadata(common)))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_kernel_is_what_runs(monkeypatch, kv_cache_dtype):
    """Guard against a silent fallback: with the torch path broken, the CPU backend still decodes."""
    common, cache, q, k, v = _decode_batch([5, 40], 4, 2, 64, 16, kv_cache_dtype=kv_cache_dtype)
    impl = CpuAttentionBackend.get_impl_cls()(4, 64, 0.125, 2, kv_cache_dtype=kv_cache_dtype)
    want = impl.forward(None, q, k, v, cache.clone(), CpuAttentionBackend.build_metadata(common))
    monkeypatch.setattr(TorchAttentionBackend.get_impl_cls(), "_decode", lambda *a: pytest.fail("fell back"))
    got = impl.forward(None, q, k, v, cache.clone(), CpuAttentionBackend.build_metadata(common))
    assert torch.equal(got, want)


@pytest.mark.parametrize("head_dim", [64, 4])  # 8 codes at a time (AVX2 + F16C), and the one-by-one decode
def test_kernel_decodes_every_fp8_code(head_dim):
    """A one-token context attends with weight 1: the output is the value row itself, decoded in C. Every e4m3fn code
    but the two NaNs (0x7f, 0xff, never written: stores saturate) must read back as torch's float8 conversion."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    seqs = 256 // head_dim
    cache = torch.zeros(2, seqs + 1, 16, 1, head_dim, dtype=torch.uint8)
    cache[1, 1:, 0, 0] = codes.view(seqs, head_dim)  # sequence i's only token sits in block i + 1
    cache = cache.view(torch.float8_e4m3fn)
    table = torch.arange(1, seqs + 1, dtype=torch.int32)[:, None]
    ones = torch.ones(seqs, dtype=torch.int32)
    rows = torch.arange(seqs, dtype=torch.int64)
    q, out = torch.randn(seqs, head_dim), torch.full((seqs, head_dim), float("nan"))
    kernel = load_paged_decode_kernel()
    assert kernel(q, rows, cache, table, ones, 0.125, None, out, 1, kv_cache_format("fp8_e4m3"))
    assert torch.equal(out, codes.view(torch.float8_e4m3fn).float().view(seqs, head_dim))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 4])  # 8 values at a time (F16C), and the one-by-one conversion
def test_kernel_reads_every_16_bit_value(dtype, head_dim):
    """A one-token context attends with weight 1: the output is the value row itself, read by the kernel from a
    bf16 / fp16 cache and rounded back to the model's dtype. Every finite value of the type (subnormals, the
    largest) must come back unchanged (-0 as 0: the accumulator starts at +0)."""
    values = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    values = values[torch.isfinite(values.float())]
    values = values[: len(values) // head_dim * head_dim]
    seqs = len(values) // head_dim
    cache = torch.zeros(2, seqs + 1, 16, 1, head_dim, dtype=dtype)
    cache[1, 1:, 0, 0] = values.view(seqs, head_dim)  # sequence i's only token sits in block i + 1
    table = torch.arange(1, seqs + 1, dtype=torch.int32)[:, None]
    ones = torch.ones(seqs, dtype=torch.int32)
    rows = torch.arange(seqs, dtype=torch.int64)
    q, out = torch.randn(seqs, head_dim).to(dtype), torch.full((seqs, head_dim), float("nan"), dtype=dtype)
    assert load_paged_decode_kernel()(q, rows, cache, table, ones, 0.125, None, out, 1, kv_cache_format("auto"))
    assert torch.equal(out, values.view(seqs, head_dim))


def test_shapes_beyond_the_kernel_fall_back_to_torch():
    # head_dim 512 exceeds the kernel's limit: the torch path runs, still right.
    for dtype, kv_cache_dtype in ((torch.float32, "auto"), (torch.float32, "int8"), (torch.bfloat16, "fp8_e4m3")):
        fmt = kv_cache_format(kv_cache_dtype)
        common, cache, q, k, v = _decode_batch([9, 30], 4, 2, 512, 16)
        q, k, v = (t.to(dtype) for t in (q, k, v))
        cache = fmt.store(cache, fmt.cache_dtype(dtype))
        outs = [b.get_impl_cls()(4, 512, 512 ** -0.5, 2, kv_cache_dtype=kv_cache_dtype).forward(
                    None, q, k, v, cache.clone(), b.build_metadata(common))
                for b in (TorchAttentionBackend, CpuAttentionBackend)]
        assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,window", [(9, 3, 64, None), (8, 2, 128, 50), (4, 4, 40, None)])
def test_a_16_bit_model_decodes_in_the_kernel(monkeypatch, dtype, kv_cache_dtype, heads, kv_heads, head_dim, window):
    """A bf16 or fp16 model's decode reads its cache (its own dtype, or fp8/int8) in place: the kernel decodes each
    value to float32 and computes in float32, so its output is the float32 attention over the very same cached
    values (the torch backend's, with q upcast), rounded once to the model's dtype. The torch path stays unused."""
    seq_lens = [1, 2, 17, 300, 64, 33]
    common, cache32, q32, k32, v32 = _decode_batch(seq_lens, heads, kv_heads, head_dim, 16)
    fmt = kv_cache_format(kv_cache_dtype)
    cache = fmt.store(cache32, fmt.cache_dtype(dtype))
    q, k, v = (t.to(dtype) for t in (q32, k32, v32))
    # The values the cache holds (and will hold for this step's k and v), exactly, in float32.
    cached = fmt.load(cache, torch.float32)
    k_held, v_held = (fmt.load(fmt.store(t.view(len(seq_lens), kv_heads, head_dim), fmt.cache_dtype(dtype)),
                               torch.float32).view(len(seq_lens), -1) for t in (k, v))
    want = TorchAttentionBackend.get_impl_cls()(heads, head_dim, head_dim ** -0.5, kv_heads, sliding_window=window
                                                ).forward(None, q.float(), k_held, v_held, cached.clone(),
                                                          TorchAttentionBackend.build_metadata(common))
    monkeypatch.setattr(TorchAttentionBackend.get_impl_cls(), "_decode", lambda *a: pytest.fail("fell back"))
    impl = CpuAttentionBackend.get_impl_cls()(heads, head_dim, head_dim ** -0.5, kv_heads, sliding_window=window,
                                              kv_cache_dtype=kv_cache_dtype)
    got = impl.forward(None, q, k, v, cache.clone(), CpuAttentionBackend.build_metadata(common))
    assert got.dtype == dtype
    # Within one rounding to the model's dtype of float32's result (a float32 summation order apart).
    torch.testing.assert_close(got.float(), want, atol=1e-5, rtol=2 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_the_graph_op_stores_and_attends_as_the_eager_path(monkeypatch, dtype, kv_cache_dtype):
    """`vx::paged_decode_attention` (what a compiled decode graph calls; the kernel stores the step's rows itself
    when they come in the cache's dtype, and reads and writes bf16 rows itself) leaves the same cache and gives
    the same output, bit for bit, as the eager path (the rows stored by index_copy_, q through float32)."""
    register_paged_decode_op()
    heads, kv_heads, head_dim = 9, 3, 64
    common, cache32, q32, k32, v32 = _decode_batch([1, 2, 17, 300, 64, 33], heads, kv_heads, head_dim, 16)
    fmt = kv_cache_format(kv_cache_dtype)
    cache = fmt.store(cache32, fmt.cache_dtype(dtype))
    q, k, v = (t.to(dtype) for t in (q32, k32, v32))
    impl = CpuAttentionBackend.get_impl_cls()(heads, head_dim, head_dim ** -0.5, kv_heads,
                                              kv_cache_dtype=kv_cache_dtype)
    eager_cache, graph_cache = cache.clone(), cache.clone()
    want = impl.forward(None, q, k, v, eager_cache, CpuAttentionBackend.build_metadata(common))
    if kv_cache_dtype == "auto":  # rows in the cache's dtype: the kernel stores them, torch does not
        import vx.gpu.attention.cpu_kernels as cpu_kernels

        monkeypatch.setattr(cpu_kernels, "KVCacheWrite", lambda *a: pytest.fail("stored through torch"))
    # In a compiled graph k often comes fresh from a fused rotary kernel while v is still a slice of qkv.
    got = torch.ops.vx.paged_decode_attention(q, k.contiguous(), v, graph_cache, common.slot_mapping,
                                              common.block_table, common.seq_lens, head_dim ** -0.5, 0, heads,
                                              kv_cache_dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(graph_cache.view(torch.uint8), eager_cache.view(torch.uint8))
    assert not torch.equal(graph_cache.view(torch.uint8), cache.view(torch.uint8))  # the step's rows were stored


def test_selection_and_switch_off(monkeypatch, tmp_path):
    assert get_attn_backend("auto", "cpu") is CpuAttentionBackend
    assert get_attn_backend("cpu", "cpu") is CpuAttentionBackend
    with pytest.raises(ValueError, match="CPU only"):
        get_attn_backend("cpu", "cuda")
    load_paged_decode_kernel.cache_clear()
    try:
        monkeypatch.setenv("VX_CPU_KERNELS", "0")
        assert get_attn_backend("auto", "cpu") is TorchAttentionBackend
        with pytest.raises(ValueError, match="could not be built"):
            get_attn_backend("cpu", "cpu")
        # A fresh cache directory: the kernel is built there, once, and found again.
        monkeypatch.setenv("VX_CPU_KERNELS", "1")
        monkeypatch.setenv("VX_CACHE_DIR", str(tmp_path))
        load_paged_decode_kernel.cache_clear()
        assert load_paged_decode_kernel() is not None
        built = list((tmp_path / "kernels").glob("paged_decode-*.so"))
        assert len(built) == 1 and not [p for p in (tmp_path / "kernels").iterdir() if p.is_dir()]
        # No compiler: the torch path, no error.
        monkeypatch.setenv("VX_CACHE_DIR", str(tmp_path / "elsewhere"))
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        load_paged_decode_kernel.cache_clear()
        assert load_paged_decode_kernel() is None
    finally:
        monkeypatch.undo()
        load_paged_decode_kernel.cache_clear()


def test_loading_the_kernel_keeps_subnormal_floats():
    """A library linked with -ffast-math switches the whole process to flush-to-zero when it loads; ours must not:
    torch, numpy and the application would silently lose every float below 1.2e-38."""
    import subprocess
    import sys

    code = ("import torch; from vx.gpu.attention.cpu_kernels import load_paged_decode_kernel, register_paged_decode_op as k; "
            "assert k() is not None; print((torch.tensor([1e-30]) * torch.tensor([1e-10])).item())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert float(out) > 0.0
