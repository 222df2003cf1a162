"""The Triton fused-MoE path equals FusedMoE's eager loop on the same routing.

CPU: the kernels run under Triton's interpreter in ONE child process (`python -m
tests.models.layers.test_fused_moe_triton --interpret-worker`, from the repository root) started with
TRITON_INTERPRET=1 in its environment: the flag must be set before triton is imported, and setting it in the pytest
process would leak into every later import of triton. The child prints one JSON line {case: max_abs_err | "error"}.
CUDA (`gpu` marker): realistic shapes in float32 and bfloat16, FusedMoE choosing the path, no host sync, a CUDA
graph replay, and the engine's greedy tokens on CUDA equal to the CPU's.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from tests.support.triton_interpreter import interpreter_results as run_interpreter, report
from vx.models.layers.fused_moe import FusedMoE


# name: (tokens, experts, top_k, hidden, intermediate, idle experts (never routed to), dtype). Hidden 40 and
# intermediate 48/24 are not tile multiples, so the masks are exercised; a few dozen rows keep the interpreter fast.
CASES = {
    "T1_E4_k1": (1, 4, 1, 32, 48, (), torch.float32),
    "T1_E8_k2": (1, 8, 2, 40, 24, (), torch.float32),
    "T7_E8_k2": (7, 8, 2, 40, 24, (), torch.float32),
    "T7_E4_k1_idle": (7, 4, 1, 32, 48, (0, 2), torch.float32),
    "T64_E8_k2": (64, 8, 2, 32, 48, (), torch.float32),
    "T64_E8_k2_idle": (64, 8, 2, 40, 24, (1, 4, 6), torch.float32),
    "T64_E4_k1": (64, 4, 1, 32, 48, (), torch.float32),
    "T7_E8_k2_float16": (7, 8, 2, 32, 48, (), torch.float16),
}
ATOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _layer(experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, device: str = "cpu",
           seed: int = 0) -> FusedMoE:
    layer = FusedMoE(experts, top_k, hidden, inter, renormalize=True, prefix="experts").to(device)
    g = torch.Generator(device).manual_seed(seed)  # drawn where they live: Qwen3-30B's experts are 600M numbers
    with torch.no_grad():
        # Scaled so that outputs stay O(1) and float16/bfloat16 errors are comparable across shapes.
        for param, fan_in in ((layer.w13_weight, hidden), (layer.w2_weight, inter)):
            param.copy_(torch.randn(param.shape, generator=g, device=device) * fan_in ** -0.5)
    return layer.to(dtype)


def _inputs(tokens: int, experts: int, hidden: int, idle: tuple[int, ...], dtype: torch.dtype, device: str = "cpu",
            seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, list(idle)] = -1e4  # these experts get no token
    return x.to(device, dtype), logits.to(device)


def _run_case(name: str) -> float:
    from vx.models.layers.fused_moe_triton import fused_experts

    tokens, experts, top_k, hidden, inter, idle, dtype = CASES[name]
    layer = _layer(experts, top_k, hidden, inter, dtype, seed=tokens)
    x, logits = _inputs(tokens, experts, hidden, idle, dtype)
    weights, ids = layer.route(logits, dtype)
    if idle:
        assert not torch.isin(ids, torch.tensor(idle)).any()
    got = fused_experts(x, layer.w13_weight, layer.w2_weight, weights, ids)
    want = layer.forward_loop(x, weights, ids)
    assert got.dtype == dtype and got.shape == want.shape
    return float((got.float() - want.float()).abs().max())


def _bf16_refused() -> float:
    """Under the interpreter bf16 must raise (its bf16 dot is wrong), not return garbage."""
    from vx.models.layers.fused_moe_triton import fused_experts

    layer = _layer(4, 2, 32, 32, torch.bfloat16)
    x, logits = _inputs(3, 4, 32, (), torch.bfloat16)
    weights, ids = layer.route(logits, torch.bfloat16)
    try:
        fused_experts(x, layer.w13_weight, layer.w2_weight, weights, ids)
    except ValueError as e:
        if "bfloat16" in str(e):
            return 0.0
        raise
    raise AssertionError("bf16 under the interpreter was not refused")


def _no_tokens() -> float:
    from vx.models.layers.fused_moe_triton import fused_experts

    layer = _layer(4, 2, 32, 32, torch.float32)
    x, logits = _inputs(0, 4, 32, (), torch.float32)
    weights, ids = layer.route(logits, torch.float32)
    out = fused_experts(x, layer.w13_weight, layer.w2_weight, weights, ids)
    assert out.shape == (0, 32)
    return 0.0


def _worker() -> None:
    checks: dict[str, Any] = {name: (lambda n=name: _run_case(n)) for name in CASES}
    checks["bf16_refused"] = _bf16_refused
    checks["no_tokens"] = _no_tokens
    report(checks)


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, Any]:
    return run_interpreter("tests.models.layers.test_fused_moe_triton")


@pytest.mark.parametrize("name", sorted(CASES) + ["bf16_refused", "no_tokens"])
def test_interpreter_matches_the_eager_loop(interpreter_results, name):
    res = interpreter_results[name]
    assert not isinstance(res, str), res
    tol = ATOL[CASES[name][6]] if name in CASES else 0.0
    assert res <= tol, f"{name}: max abs error {res}"


# ---- CUDA --------------------------------------------------------------------------------------------

# (tokens, experts, top_k, hidden, intermediate): a decode batch and a prefill on Qwen3-30B-A3B's expert shape
# (128 experts, top 8, hidden 2048, intermediate 768), and Mixtral's routing (8 experts, top 2) on a smaller width.
GPU_SHAPES = {"decode_qwen3": (8, 128, 8, 2048, 768), "prefill_qwen3": (300, 128, 8, 2048, 768),
              "mixtral": (77, 8, 2, 1024, 3584), "one_token": (1, 8, 2, 512, 256)}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_the_eager_loop_on_cuda(shape, dtype):
    tokens, experts, top_k, hidden, inter = GPU_SHAPES[shape]
    layer = _layer(experts, top_k, hidden, inter, dtype, device="cuda")
    x, logits = _inputs(tokens, experts, hidden, (3,), dtype, device="cuda")
    weights, ids = layer.route(logits, dtype)
    from vx.models.layers.fused_moe_triton import fused_experts

    got = fused_experts(x, layer.w13_weight, layer.w2_weight, weights, ids).float()
    want = layer.forward_loop(x, weights, ids).float()
    # bfloat16: the loop rounds gate and up to bf16 before SiLU-and-mul, the kernel after it (fp32 accumulators).
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel <= (2e-2 if dtype == torch.bfloat16 else 1e-5), f"{shape} {dtype}: max error {rel} of max |out|"


@pytest.mark.gpu
def test_fused_moe_takes_the_triton_path_on_cuda_without_a_host_sync(monkeypatch):
    from vx.models.layers import fused_moe_triton

    calls = []
    real = fused_moe_triton.fused_experts
    monkeypatch.setattr(fused_moe_triton, "fused_experts", lambda *a: (calls.append(1), real(*a))[1])
    layer = _layer(16, 4, 256, 128, torch.bfloat16, device="cuda")
    x, logits = _inputs(33, 16, 256, (), torch.bfloat16, device="cuda")
    layer(x, logits)  # compiles the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device->host copy or sync now raises
    try:
        out = layer(x, logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert calls == [1, 1]
    weights, ids = layer.route(logits, torch.bfloat16)
    torch.testing.assert_close(out.float(), layer.forward_loop(x, weights, ids).float(), atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
def test_fused_moe_replays_from_a_cuda_graph():
    layer = _layer(16, 4, 256, 128, torch.float32, device="cuda")
    x, logits = _inputs(8, 16, 256, (), torch.float32, device="cuda")
    static_x, static_logits = x.clone(), logits.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(static_x, static_logits)  # warm-up: compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x, static_logits)
    for seed in (5, 6):  # new tokens and a new routing, replayed
        new_x, new_logits = _inputs(8, 16, 256, (seed,), torch.float32, device="cuda", seed=seed)
        static_x.copy_(new_x)
        static_logits.copy_(new_logits)
        graph.replay()
        torch.testing.assert_close(static_out, layer(new_x, new_logits), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_engine_greedy_on_cuda_equals_cpu(tiny_model_dirs, family):
    """The whole engine in float32: the MoE layers on Triton (CUDA) give the CPU loop's greedy tokens."""
    import vx

    prompts = [[(7 * i + j) % 300 + 1 for j in range(n)] for i, n in enumerate((1, 5, 17, 40))]
    params = vx.SamplingParams(temperature=0.0, max_tokens=12)
    tokens = {}
    # "cuda, graphs": triton attention, and the MoE layers inside the decode steps' CUDA graphs.
    for name, device, backend in (("cpu", "cpu", "torch"), ("cuda", "cuda", "torch"), ("cuda, graphs", "cuda", "auto")):
        llm = vx.LLM(tiny_model_dirs[family], dtype="float32", device=device, attention_backend=backend)
        tokens[name] = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert tokens["cuda"] == tokens["cpu"]
    assert tokens["cuda, graphs"] == tokens["cpu"]


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    _worker()
