"""Triton paged-attention backend equals the torch backend, plus the backend selector.

CPU: the kernels run under Triton's interpreter in ONE child process (`python -m
tests.gpu.attention.test_triton_backend --interpret-worker`, from the repository root) started with
TRITON_INTERPRET=1 in its environment. The flag must be set before triton is imported, and setting it in the pytest process would leak into every later import of triton
(the interpreter replaces compiled kernels process-wide); the child keeps it contained and pays the
import cost once for all cases. The child prints one JSON line {case: max_abs_err | "error text"}.
Quantized caches (fp8_e4m3, int8): the same cases with the cache stored in 8 bits; triton must write the bytes torch
writes, attend like torch over them, and stay within FLOAT_CACHE_TOL of the float cache.
CUDA (`gpu` marker): the same comparison on realistic shapes in bf16/fp32, and the engine end to end.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from tests.support.attention_cases import (EXACT_TOL, FLOAT_CACHE_TOL, compare, compare_to_float, make_case,
                                           run_backend)
from tests.support.triton_interpreter import interpreter_results as run_interpreter, report
from vx.gpu.attention import get_attn_backend
from vx.gpu.attention.flash_attn_backend import FlashAttnBackend
from vx.gpu.attention.torch_backend import TorchAttentionBackend
from vx.gpu.attention.triton_backend import TritonAttentionBackend

F32, F16 = torch.float32, torch.float16

# name: (num_computed per request, num_new per request, (heads, kv_heads), head_dim, block_size, window,
#        dtype, padding rows). head_dim 32 and <= 40 tokens keep the interpreter fast.
CASES = {
    "prefill_gqa": ([0, 0], [7, 12], (4, 2), 32, 4, None, F32, 3),
    "prefill_mha": ([0, 0, 0], [5, 1, 9], (2, 2), 32, 8, None, F32, 3),
    "decode_gqa": ([3, 16, 9], [1, 1, 1], (4, 2), 32, 4, None, F32, 2),
    "decode_mha_block16": ([5, 0, 20], [1, 1, 1], (2, 2), 32, 16, None, F32, 1),
    "mixed_chunked_gqa": ([9, 0, 5], [1, 6, 9], (4, 2), 32, 4, None, F32, 3),
    "mixed_chunked_mha": ([4, 10, 0], [6, 1, 8], (2, 2), 32, 8, None, F32, 0),
    "window_gqa": ([12, 0, 6], [1, 10, 8], (4, 2), 32, 4, 5, F32, 3),
    "window_mha_decode": ([20, 7], [1, 1], (2, 2), 32, 4, 6, F32, 1),
    "mqa_block16": ([0, 14], [16, 1], (4, 1), 32, 16, None, F32, 2),
    "head_dim64_gqa": ([6, 0], [4, 9], (4, 2), 64, 8, None, F32, 1),
    "float16_mixed": ([9, 0, 5], [1, 6, 9], (4, 2), 32, 4, None, F16, 3),
}
ATOL = {F32: 1e-3, F16: 1e-2}
# name: (a CASES entry, kv_cache_dtype): prefill, decode, mixed, sliding window, fp16, over both quantized formats.
QUANT_CASES = {f"{base}_{kv}": (base, kv) for kv in ("fp8_e4m3", "int8")
               for base in ("prefill_gqa", "decode_gqa", "mixed_chunked_gqa", "window_gqa", "head_dim64_gqa",
                            "float16_mixed")}

# name: (a CASES entry, soft cap): Gemma 2's capped scores; a cap of 1 bends every score of these random inputs.
SOFT_CAP_CASES = {f"{base}_soft_cap": (base, 1.0) for base in ("prefill_gqa", "mixed_chunked_gqa", "window_gqa")}


def _case(name: str, kv_cache_dtype: str = "auto", soft_cap: float | None = None):
    computed, new, heads, head_dim, block_size, window, dtype, pad = CASES[name]
    return make_case(computed, new, heads, head_dim, block_size, dtype=dtype, window=window, pad=pad,
                     seed=len(name), kv_cache_dtype=kv_cache_dtype, soft_cap=soft_cap)


def _run_case(name: str) -> float:
    return compare(TritonAttentionBackend, TorchAttentionBackend, _case(name))


def _run_soft_cap_case(name: str) -> float:
    base, cap = SOFT_CAP_CASES[name]
    return compare(TritonAttentionBackend, TorchAttentionBackend, _case(base, soft_cap=cap))


def _run_quant_case(name: str) -> list[float]:
    """[max error against torch on the same quantized cache, against the float cache's output]."""
    base, kv = QUANT_CASES[name]
    case = _case(base, kv)
    return [compare(TritonAttentionBackend, TorchAttentionBackend, case),
            compare_to_float(TritonAttentionBackend, case, TorchAttentionBackend)[1]]


def _fp8_codes_decode() -> float:
    """The kernels' fp8 decoder on every e4m3fn code but the NaNs (never written: stores saturate), against torch's
    float8 conversion."""
    from tests.support.triton_probes import decode_fp8

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    return float((decode_fp8(codes) - codes.view(torch.float8_e4m3fn).float()).abs().max())


def _bf16_refused() -> float:
    """Under the interpreter bf16 must raise (its bf16 dot is wrong), not return garbage."""
    case = make_case([2], [3], (2, 2), 32, 4, dtype=torch.bfloat16)
    try:
        compare(TritonAttentionBackend, TorchAttentionBackend, case)
    except ValueError as e:
        if "bfloat16" in str(e):
            return 0.0
        raise
    raise AssertionError("bf16 under the interpreter was not refused")


def _decode_graph_metadata() -> float:
    """A decode step through `DecodeGraphMetadata` (what a CUDA graph's layers get) against the same step through
    the backend's own metadata: the same cache bytes written, the same outputs."""
    from vx.gpu.attention.backend import DecodeGraphMetadata

    graph_case = make_case([20, 7, 3], [1, 1, 1], (4, 2), 32, 4, window=6, pad=0, seed=5)
    common = graph_case.common
    n = common.num_actual_tokens
    md = DecodeGraphMetadata(slot_mapping=common.slot_mapping[:n].long(),
                             block_table=common.block_table.to(torch.int32).contiguous(),
                             seq_lens=common.seq_lens.to(torch.int32))
    impl = TritonAttentionBackend.get_impl_cls()(4, 32, 32 ** -0.5, 2, sliding_window=6)
    cache = graph_case.cache.clone()
    out = impl.forward(None, graph_case.q, graph_case.k, graph_case.v, cache, md)
    ref_out, ref_cache = run_backend(TritonAttentionBackend, graph_case)
    assert torch.equal(cache, ref_cache), "the graph path wrote other cache rows"
    return float((out[:n] - ref_out[:n]).abs().max())


def _worker() -> None:
    assert get_attn_backend("triton", "cpu") is TritonAttentionBackend
    results: dict[str, float | list[float] | str] = {}
    checks: dict[str, Any] = {name: (lambda n=name: _run_case(n)) for name in CASES}
    checks.update({name: (lambda n=name: _run_quant_case(n)) for name in QUANT_CASES})
    checks.update({name: (lambda n=name: _run_soft_cap_case(n)) for name in SOFT_CAP_CASES})
    checks["bf16_refused"] = _bf16_refused
    checks["fp8_codes"] = _fp8_codes_decode
    checks["decode_graph_metadata"] = _decode_graph_metadata
    report(checks)


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, Any]:
    return run_interpreter("tests.gpu.attention.test_triton_backend")


@pytest.mark.parametrize("name", sorted(CASES) + ["bf16_refused", "fp8_codes", "decode_graph_metadata"])
def test_interpreter_matches_torch(interpreter_results, name):
    res = interpreter_results[name]
    assert not isinstance(res, str), res
    tol = ATOL[CASES[name][6]] if name in CASES else 0.0
    assert res <= tol, f"{name}: max abs error {res}"


@pytest.mark.parametrize("name", sorted(SOFT_CAP_CASES))
def test_interpreter_soft_capped_scores_match_torch(interpreter_results, name):
    """Gemma 2's soft cap in the kernel (scores -> cap * tanh(scores / cap)) gives torch's output."""
    res = interpreter_results[name]
    assert not isinstance(res, str), res
    assert res <= ATOL[F32], f"{name}: {res}"


@pytest.mark.parametrize("name", sorted(QUANT_CASES))
def test_interpreter_quantized_cache(interpreter_results, name):
    res = interpreter_results[name]
    assert not isinstance(res, str), res
    against_torch, against_float = res
    base, kv = QUANT_CASES[name]
    # Same bytes read, float32 sums in another order (float16 cases: ATOL, as without quantization).
    assert against_torch <= (EXACT_TOL if CASES[base][6] == F32 else ATOL[F16]), f"{name}: {against_torch}"
    assert 0 < against_float <= FLOAT_CACHE_TOL[kv], f"{name}: {against_float}"


# ---- selector ----------------------------------------------------------------------------------------

def test_selector_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    # "auto" on CPU never picks triton: the cpu backend when its C kernel builds, else torch.
    assert get_attn_backend("auto", "cpu").get_name() in ("cpu", "torch")
    assert get_attn_backend("torch", "cpu") is TorchAttentionBackend
    assert get_attn_backend("torch", "cuda") is TorchAttentionBackend
    with pytest.raises(ValueError, match="triton needs CUDA or TRITON_INTERPRET=1"):
        get_attn_backend("triton", "cpu")
    with pytest.raises(ValueError, match="flash_attn needs CUDA"):
        get_attn_backend("flash_attn", "cpu")
    with pytest.raises(ValueError, match="Unknown attention_backend"):
        get_attn_backend("xformers", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert get_attn_backend("triton", "cpu") is TritonAttentionBackend
    assert get_attn_backend("auto", "cpu").get_name() != "triton"  # the interpreter is for tests only
    with pytest.raises(ValueError, match="head_dim"):
        get_attn_backend("triton", "cpu", head_dim=512)
    with pytest.raises(ValueError, match="power-of-two block_size"):
        get_attn_backend("triton", "cpu", block_size=12)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusals")
def test_selector_without_cuda():
    with pytest.raises(ValueError, match="triton needs CUDA"):
        get_attn_backend("triton", "cuda")
    with pytest.raises(ValueError, match="flash_attn needs CUDA"):
        get_attn_backend("flash_attn", "cuda")


def test_selector_auto_on_cuda(monkeypatch):
    """With CUDA faked: flash_attn when it fits (bf16, 256-token blocks), else triton, else torch."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    try:
        import flash_attn  # noqa: F401
    except Exception:
        with pytest.raises(ValueError, match="flash_attn is not importable"):
            get_attn_backend("flash_attn", "cuda")
        assert get_attn_backend("auto", "cuda") is TritonAttentionBackend
    monkeypatch.setattr(FlashAttnBackend, "unavailable_reason", staticmethod(lambda device: None))
    assert get_attn_backend("auto", "cuda", dtype=torch.bfloat16, block_size=256) is FlashAttnBackend
    assert get_attn_backend("auto", "cuda", dtype=torch.bfloat16, block_size=16) is TritonAttentionBackend
    assert get_attn_backend("auto", "cuda", dtype=torch.float32, block_size=256) is TritonAttentionBackend
    with pytest.raises(ValueError, match="float16/bfloat16 only"):
        get_attn_backend("flash_attn", "cuda", dtype=torch.float32)
    monkeypatch.setattr(TritonAttentionBackend, "unavailable_reason", staticmethod(lambda device: "no"))
    assert get_attn_backend("auto", "cuda", dtype=torch.float32) is TorchAttentionBackend


# ---- CUDA --------------------------------------------------------------------------------------------

GPU_SHAPES = {
    # (computed, new): prefills, a chunk continuing its cache, decodes with long contexts: ~400 tokens
    "mixed": ([0, 0, 150, 37, 300, 500, 64], [200, 33, 1, 1, 64, 1, 96]),
    "decodes": ([17, 255, 256, 511, 1000, 3], [1, 1, 1, 1, 1, 1]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("heads,head_dim,window", [((32, 8), 128, None), ((16, 16), 64, None),
                                                   ((12, 2), 64, 100), ((8, 1), 128, None)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_matches_torch_on_cuda(shape, heads, head_dim, window, dtype):
    computed, new = GPU_SHAPES[shape]
    case = make_case(computed, new, heads, head_dim, 16, dtype=dtype, device="cuda", window=window, pad=5)
    assert get_attn_backend("triton", "cuda", dtype=dtype, head_dim=head_dim) is TritonAttentionBackend
    err = compare(TritonAttentionBackend, TorchAttentionBackend, case)
    assert err <= (3e-2 if dtype == torch.bfloat16 else 1e-3), err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_soft_caps_scores_on_cuda(dtype):
    computed, new = GPU_SHAPES["mixed"]
    case = make_case(computed, new, (8, 4), 256, 16, dtype=dtype, device="cuda", window=64, pad=5, soft_cap=2.0)
    err = compare(TritonAttentionBackend, TorchAttentionBackend, case)
    assert err <= (3e-2 if dtype == torch.bfloat16 else 1e-3), err


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_reads_a_quantized_cache_on_cuda(shape, kv_cache_dtype, dtype):
    computed, new = GPU_SHAPES[shape]
    case = make_case(computed, new, (32, 8), 128, 16, dtype=dtype, device="cuda", pad=5, kv_cache_dtype=kv_cache_dtype)
    assert get_attn_backend("auto", "cuda", dtype=dtype, head_dim=128, block_size=16,
                            kv_cache_dtype=kv_cache_dtype) is TritonAttentionBackend
    err = compare(TritonAttentionBackend, TorchAttentionBackend, case)
    assert err <= (3e-2 if dtype == torch.bfloat16 else 1e-3), err
    assert compare_to_float(TritonAttentionBackend, case, TorchAttentionBackend)[1] <= FLOAT_CACHE_TOL[kv_cache_dtype]


@pytest.mark.gpu
def test_engine_greedy_triton_equals_torch_on_cuda(tiny_model_dir):
    """The whole engine on CUDA in float32: triton attention gives torch attention's greedy tokens."""
    import vx

    prompts = [[(7 * i + j) % 300 + 1 for j in range(n)] for i, n in enumerate((1, 5, 17, 40, 64))]
    params = vx.SamplingParams(temperature=0.0, max_tokens=16)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = vx.LLM(tiny_model_dir, dtype="float32", device="cuda", attention_backend=backend,
                     max_num_batched_tokens=32)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert tokens["triton"] == tokens["torch"]


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    _worker()
