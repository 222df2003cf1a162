"""The MLA backend: latent rows cached as they are, outputs equal to dense attention over the expanded keys and
values, and the Triton decode kernel equal to the torch one.

CPU: the torch paths run here; the Triton kernel runs under Triton's interpreter in one child process (`python -m
tests.gpu.attention.test_mla_backend --interpret-worker`, TRITON_INTERPRET=1 in its environment only, as
test_triton_backend explains), which prints one JSON line {case: max_abs_err | "error text"}.
CUDA (`gpu` marker): the kernel on DeepSeek-V2-Lite's shape in bf16/fp32, and the engine end to end against HF.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from tests.support.mla_cases import MLACase, make_mla_case, mla_reference
from tests.support.triton_interpreter import interpreter_results as run_interpreter, report
from vx.gpu.attention import get_attn_backend
from vx.gpu.attention.mla_backend import MLAAttentionBackend, mla_decode_torch


# name: (computed per request, new per request): prefills, a chunk continuing a cached prefix, decodes, and a mix
# with decodes of different lengths (several length groups).
STEPS = {
    "prefill": ([0, 0], [7, 12]),
    "chunk_after_prefix": ([9], [6]),
    "decodes": ([5, 30, 1], [1, 1, 1]),
    "mixed": ([0, 13, 40, 3, 0], [5, 1, 1, 8, 1]),
}


def run_mla(case: MLACase, decode_kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(output, cache after the step) of the MLA backend on a copy of the case's cache."""
    cache = case.cache.clone()
    impl = MLAAttentionBackend.get_impl_cls()(case.layer.num_heads, case.layer.head_dim, case.layer.scale, 1,
                                               decode_kernel=decode_kernel)
    out = impl.forward(case.layer, case.q, case.rows, None, cache, MLAAttentionBackend.build_metadata(case.common))
    return out, cache


def _written_rows_ok(case: MLACase, cache: torch.Tensor) -> bool:
    n = case.common.num_actual_tokens
    slots = case.common.slot_mapping[:n].long()
    return bool(torch.equal(cache.view(-1, cache.shape[-1])[slots], case.rows[:n]) and not (cache == 99.0).any())


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("block_size", [4, 16])
def test_mla_torch_equals_dense_attention(step, block_size):
    """Prefills expanded through kv_b_proj and decodes in the absorbed form both equal attention over every head's
    expanded keys and values; the cache holds exactly the step's latent rows at their slots, padding rows none."""
    computed, new = STEPS[step]
    case = make_mla_case(computed, new, block_size=block_size, seed=len(step))
    out, cache = run_mla(case, "torch")
    n = case.common.num_actual_tokens
    assert out.shape == (n + 3, case.layer.num_heads * case.layer.v_head_dim)
    assert torch.all(out[n:] == 0), "padding rows must be zero"
    assert _written_rows_ok(case, cache)
    assert float((out[:n].double() - mla_reference(case)).abs().max()) < 1e-5


def test_the_cache_row_is_the_latent_and_rope_part_only():
    """What a token costs in the cache: kv_lora_rank + qk_rope_head_dim values in one row, no key/value pair."""
    case = make_mla_case([0], [3], heads=8, rank=32, rope=16)
    assert case.layer.head_dim == 48 and case.layer.num_kv_heads == 1
    assert MLAAttentionBackend.get_kv_cache_shape(10, 4, 1, 48) == (10, 4, 1, 48)


def test_selector_picks_mla_for_mla_models_only():
    assert get_attn_backend("auto", "cpu", mla=True) is MLAAttentionBackend
    assert get_attn_backend("mla", "cpu", mla=True) is MLAAttentionBackend
    with pytest.raises(ValueError, match="cannot serve a multi-head latent attention model"):
        get_attn_backend("torch", "cpu", mla=True)
    with pytest.raises(ValueError, match="DeepSeek-V2\\) only"):
        get_attn_backend("mla", "cpu")
    assert get_attn_backend("auto", "cpu") is not MLAAttentionBackend
    with pytest.raises(ValueError, match="kv_cache_dtype='auto' only"):
        get_attn_backend("auto", "cpu", mla=True, kv_cache_dtype="fp8_e4m3")


# ------------------------------------------------------------------------- the Triton decode kernel, interpreted
def _decode_inputs(seq_lens: list[int], heads: int, rank: int, rope: int, block_size: int, dtype: torch.dtype,
                   device: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random absorbed queries and a shuffled paged latent cache for single-token decodes."""
    gen = torch.Generator().manual_seed(seed)
    nb = max(-(-s // block_size) for s in seq_lens)
    num_blocks = nb * len(seq_lens) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    table = perm[:nb * len(seq_lens)].view(len(seq_lens), nb).to(torch.int32)
    cache = torch.randn(num_blocks, block_size, 1, rank + rope, generator=gen).to(dtype)
    q_lat = (torch.randn(len(seq_lens), heads, rank, generator=gen) * rank ** -0.5).to(dtype)
    q_pe = torch.randn(len(seq_lens), heads, rope, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (q_lat, q_pe, cache, table, lens))


# name: (seq_lens, heads, kv_lora_rank, qk_rope_head_dim, block_size, dtype)
KERNEL_CASES = {
    "f32_tiny_shape": ([1, 9, 33], 4, 32, 16, 4, "float32"),
    "f32_head_tiles_and_odd_rank": ([17, 2, 40], 20, 48, 8, 8, "float32"),  # 2 head tiles, rank/rope padded
    "f16_blocks_of_16": ([5, 64, 31, 1], 16, 64, 16, 16, "float16"),
}


def _kernel_case(name: str) -> float:
    from vx.gpu.attention.mla_kernels import mla_decode_triton

    seq_lens, heads, rank, rope, bs, dtype = KERNEL_CASES[name]
    q_lat, q_pe, cache, table, lens = _decode_inputs(seq_lens, heads, rank, rope, bs, getattr(torch, dtype), "cpu")
    got = mla_decode_triton(q_lat, q_pe, cache, table, lens, 0.3)
    want = mla_decode_torch(q_lat.float(), q_pe.float(), cache.float(), table, lens, 0.3)
    return float((got.float() - want).abs().max())


def _impl_case() -> float:
    """The backend's decode through the kernel equals its torch decode on a mixed step (prefills run in torch)."""
    case = make_mla_case(*STEPS["mixed"], seed=3)
    out, cache = run_mla(case, "triton")
    ref, ref_cache = run_mla(case, "torch")
    assert torch.equal(cache, ref_cache)
    return float((out - ref).abs().max())


def _worker() -> None:
    checks: dict[str, Any] = {name: (lambda n=name: _kernel_case(n)) for name in KERNEL_CASES}
    checks["impl_mixed_step"] = _impl_case
    report(checks)


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, Any]:
    return run_interpreter("tests.gpu.attention.test_mla_backend")


@pytest.mark.parametrize("name", sorted(KERNEL_CASES) + ["impl_mixed_step"])
def test_triton_decode_kernel_interpreted_equals_torch(interpreter_results, name):
    res = interpreter_results[name]
    assert not isinstance(res, str), res
    tol = 2e-3 if name in KERNEL_CASES and KERNEL_CASES[name][5] == "float16" else 1e-5
    assert res <= tol, f"{name}: max abs error {res}"


# ------------------------------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_decode_kernel_on_cuda_lite_shape(dtype):
    """DeepSeek-V2-Lite's decode shape (16 heads, kv_lora_rank 512, rope 64), blocks of 16, long and short contexts."""
    from vx.gpu.attention.mla_kernels import mla_decode_triton

    seq_lens = [1, 17, 300, 1000, 64, 2048, 5]
    q_lat, q_pe, cache, table, lens = _decode_inputs(seq_lens, 16, 512, 64, 16, dtype, "cuda")
    got = mla_decode_triton(q_lat, q_pe, cache, table, lens, 192 ** -0.5)
    want = mla_decode_torch(q_lat.float(), q_pe.float(), cache.float(), table, lens, 192 ** -0.5)
    assert float((got.float() - want).abs().max()) <= (2e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.gpu
def test_mla_backend_on_cuda_equals_dense_attention():
    case = make_mla_case(*STEPS["mixed"], block_size=16, device="cuda", seed=7)
    out, cache = run_mla(case)  # auto: the Triton decode kernel on CUDA
    n = case.common.num_actual_tokens
    assert _written_rows_ok(case, cache)
    assert float((out[:n].double() - mla_reference(case)).abs().max()) < 1e-4


@pytest.mark.gpu
def test_engine_deepseek_v2_greedy_equals_hf_on_cuda(tiny_model_dirs):
    """The whole engine on CUDA in float32 (MLA backend, Triton decode): Hugging Face's greedy tokens."""
    from transformers import AutoModelForCausalLM

    import vx

    path = tiny_model_dirs["deepseek_v2"]
    prompts = [[(7 * i + j) % 300 + 1 for j in range(n)] for i, n in enumerate((1, 5, 17, 40, 64))]
    llm = vx.LLM(path, dtype="float32", device="cuda", max_num_batched_tokens=32)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, vx.SamplingParams(temperature=0.0, max_tokens=16),
                                                       use_tqdm=False)]
    llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p, g in zip(prompts, got):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
        assert g == want


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    _worker()
