"""Torch paged-attention backend (and the CPU backend, which swaps in a C decode kernel) against a naive
per-query softmax, for every batch mix and KV-cache format (a quantized cache against the softmax over what it gives
back, and within FLOAT_CACHE_TOL of the float cache)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tests.support.attention_cases import EXACT_TOL, FLOAT_CACHE_TOL, compare_to_float, make_case
from tests.support.paged_attention import make_common_metadata
from vx.gpu.attention import CommonAttentionMetadata, get_attn_backend
from vx.gpu.attention.backend import as_bytes, slot_views
from vx.gpu.attention.cpu_backend import CpuAttentionBackend
from vx.gpu.attention.cpu_kernels import load_paged_decode_kernel
from vx.gpu.attention.kv_format import kv_cache_format
from vx.gpu.attention.torch_backend import TorchAttentionBackend

BLOCK_SIZE = 4
NUM_BLOCKS = 40


def _reference(q, k_full, v_full, computed, scale, window, soft_cap=None):
    """q [n, H, D] of positions computed..computed+n-1; k/v_full [computed+n, Hk, D]; scores soft-capped
    (cap * tanh(scores / cap)) when `soft_cap` is set."""
    h, hk = q.shape[1], k_full.shape[1]
    k = k_full.repeat_interleave(h // hk, dim=1).float()
    v = v_full.repeat_interleave(h // hk, dim=1).float()
    out = torch.empty(q.shape, dtype=torch.float32)
    for j in range(q.shape[0]):
        pos = computed + j
        lo = 0 if window is None else max(0, pos - window + 1)
        scores = torch.einsum("hd,lhd->hl", q[j].float(), k[lo:pos + 1]) * scale
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        out[j] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[lo:pos + 1])
    return out


CASES = {
    # (num_computed, num_new) per request
    "prefills": ([0, 0, 0], [7, 1, 12]),
    "chunked": ([5, 8], [6, 9]),
    "decodes": ([3, 16, 0, 9], [1, 1, 1, 1]),
    "mixed": ([9, 0, 20, 4, 0], [1, 6, 1, 5, 1]),
}


BACKENDS = [TorchAttentionBackend, pytest.param(CpuAttentionBackend, marks=pytest.mark.skipif(
    load_paged_decode_kernel() is None, reason="the CPU kernel cannot be built here (no C compiler)"))]


@pytest.mark.parametrize("backend", BACKENDS, ids=["torch", "cpu"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads,window,dtype,kv_cache_dtype,soft_cap", [
    ((4, 2), None, torch.float32, "auto", None), ((2, 2), None, torch.float32, "auto", None),
    ((4, 2), 5, torch.float32, "auto", None), ((2, 2), 5, torch.float32, "auto", None),
    ((4, 2), None, torch.bfloat16, "auto", None),
    ((4, 2), None, torch.float32, "fp8_e4m3", None), ((2, 2), 5, torch.float32, "fp8_e4m3", None),
    ((4, 2), None, torch.bfloat16, "fp8_e4m3", None),
    ((4, 2), None, torch.float32, "int8", None), ((2, 2), 5, torch.float32, "int8", None),
    ((4, 2), None, torch.bfloat16, "int8", None),
    # Gemma 2's attention soft-capping, with and without a window (a cap of 1 bends every score here).
    ((4, 2), None, torch.float32, "auto", 1.0), ((2, 2), 5, torch.float32, "auto", 1.0),
])
def test_matches_naive_attention(case, heads, window, dtype, kv_cache_dtype, soft_cap, backend):
    """Against a naive softmax over the keys and values the cache gives back (for "auto" the exact ones)."""
    torch.manual_seed(0)
    computed, new = CASES[case]
    h, hk, d = heads[0], heads[1], 8
    fmt = kv_cache_format(kv_cache_dtype)
    cache_dtype = fmt.cache_dtype(dtype)

    def stored(x):  # the rows the cache holds for x
        return fmt.store(x, cache_dtype)

    scale = 1 / math.sqrt(d)
    pool = list(range(NUM_BLOCKS))
    random.Random(1).shuffle(pool)
    tables = [[pool.pop() for _ in range(-(-(c + n) // BLOCK_SIZE))] for c, n in zip(computed, new)]
    cache = torch.zeros(TorchAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, hk, fmt.row_width(d)),
                        dtype=cache_dtype)
    k_cache, v_cache = (as_bytes(c) for c in slot_views(cache))
    full_k, full_v = [], []
    for c, n, bt in zip(computed, new, tables):
        full_k.append(torch.randn(c + n, hk, d).to(dtype))
        full_v.append(torch.randn(c + n, hk, d).to(dtype))
        ctx_slots = [bt[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c)]
        k_cache[ctx_slots] = as_bytes(stored(full_k[-1][:c]))  # the cached prefix, written by an earlier "step"
        v_cache[ctx_slots] = as_bytes(stored(full_v[-1][:c]))
    pad = 3
    common = make_common_metadata(computed, new, tables, BLOCK_SIZE, num_padding_tokens=pad)
    n_tok = common.num_actual_tokens + pad
    q = torch.randn(n_tok, h, d).to(dtype)
    k = torch.cat([fk[c:] for fk, c in zip(full_k, computed)] + [torch.full((pad, hk, d), 99.0, dtype=dtype)])
    v = torch.cat([fv[c:] for fv, c in zip(full_v, computed)] + [torch.full((pad, hk, d), 99.0, dtype=dtype)])
    impl = backend.get_impl_cls()(h, d, scale, hk, sliding_window=window, kv_cache_dtype=kv_cache_dtype,
                                  logits_soft_cap=soft_cap)
    md = backend.build_metadata(common)
    out = impl.forward(None, q.reshape(n_tok, -1), k.reshape(n_tok, -1), v.reshape(n_tok, -1), cache, md)
    assert out.shape == (n_tok, h * d) and out.dtype == dtype
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    qsl = common.query_start_loc_cpu.tolist()
    written = []
    for i, (c, bt) in enumerate(zip(computed, tables)):
        read_back_k, read_back_v = (fmt.load(stored(x), dtype) for x in (full_k[i], full_v[i]))
        ref = _reference(q[qsl[i]:qsl[i + 1]], read_back_k, read_back_v, c, scale, window, soft_cap)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].float(), ref.reshape(-1, h * d), atol=atol, rtol=0)
        slots = [bt[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c + new[i])]
        assert torch.equal(k_cache[slots], as_bytes(stored(full_k[i])))
        assert torch.equal(v_cache[slots], as_bytes(stored(full_v[i])))
        written += slots
    assert torch.all(out[-pad:] == 0)
    unwritten = sorted(set(range(k_cache.shape[0])) - set(written))
    assert not k_cache[unwritten].any() and not v_cache[unwritten].any(), "padding tokens must not be written"


# make_case's batches: (computed, new, (heads, kv_heads), head_dim, block_size, window)
QUANT_CASES = {
    "prefills": ([0, 0], [7, 12], (4, 2), 32, 4, None),
    "decodes": ([300, 511, 64, 33], [1, 1, 1, 1], (9, 3), 64, 16, None),
    "mixed": ([9, 0, 5], [1, 6, 9], (4, 2), 32, 4, None),
    "window": ([12, 0, 6, 130], [1, 10, 8, 1], (8, 2), 128, 16, 5),
}


@pytest.mark.parametrize("backend", BACKENDS, ids=["torch", "cpu"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("name", sorted(QUANT_CASES))
def test_quantized_cache_against_float_cache(backend, kv_cache_dtype, name):
    case = make_case(*QUANT_CASES[name][:5], window=QUANT_CASES[name][5], kv_cache_dtype=kv_cache_dtype)
    exact, to_float = compare_to_float(backend, case, TorchAttentionBackend)
    assert exact <= EXACT_TOL
    assert 0 < to_float <= FLOAT_CACHE_TOL[kv_cache_dtype]


def test_metadata_split_and_contiguous_decode_rows():
    common = make_common_metadata([4, 0, 7, 2], [1, 5, 1, 1], [[3, 4], [0, 5], [1, 2], [6]], BLOCK_SIZE)
    md = TorchAttentionBackend.build_metadata(common)
    assert md.num_decodes == 3 and len(md.prefills) == 1 and md.prefills[0].ctx_slots is None
    # Longest first; a request under half its group's longest context starts a new group.
    long_group, short_group = md.decode_groups
    assert torch.equal(long_group.rows, torch.tensor([6, 0]))
    assert long_group.blocks.tolist() == [[1, 2], [3, 4]] and long_group.seq_lens.flatten().tolist() == [8, 5]
    assert md.decode_mask(0, None)[1, 0, 0].tolist() == [True] * 5 + [False] * 3
    assert short_group.rows == slice(7, 8) and short_group.blocks.tolist() == [[6]]
    assert md.decode_mask(1, None)[0, 0, 0].tolist() == [True] * 3 + [False]
    assert md.decode_mask(1, 2)[0, 0, 0].tolist() == [False, True, True, False]  # sliding window of 2
    common = make_common_metadata([0, 3, 3], [6, 1, 1], [[0, 1], [2], [3]], BLOCK_SIZE)
    md = TorchAttentionBackend.build_metadata(common)
    assert [g.rows for g in md.decode_groups] == [slice(6, 8)] and md.kv_write.rows is None


def test_selector():
    expected_cpu = TorchAttentionBackend if load_paged_decode_kernel() is None else CpuAttentionBackend
    assert get_attn_backend("auto", "cpu") is expected_cpu
    assert get_attn_backend("torch", "cuda") is TorchAttentionBackend
    assert TorchAttentionBackend.get_name() == "torch"
    with pytest.raises(ValueError, match="flash_attn needs CUDA"):  # more in test_triton_backend.py
        get_attn_backend("flash_attn", "cpu")
    with pytest.raises(ValueError, match="Unknown"):
        get_attn_backend("xformers", "cpu")
    assert isinstance(make_common_metadata([0], [2], [[0]], BLOCK_SIZE), CommonAttentionMetadata)


def test_backends_without_soft_capping_refuse_a_capped_layer():
    from vx.gpu.attention.flash_attn_backend import FlashAttnBackend

    with pytest.raises(ValueError, match="soft-capping"):
        FlashAttnBackend.get_impl_cls()(4, 16, 0.25, 2, logits_soft_cap=50.0)
