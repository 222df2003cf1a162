"""Runs of one workload through engines whose model is split over workers, and the comparison with the whole
model (tests/executor/): 8 prompts, 16-token prefill chunks, a KV cache small enough to force preemption; greedy
tokens exactly, logprobs and prompt logprobs within 1e-5 (float32)."""

from __future__ import annotations

import random
from typing import Any

import vx

MAX_NEW = 16
# 16-token prefill chunks, and a KV cache too small for the 8 prompts at once: the scheduler preempts.
ENGINE = dict(dtype="float32", device="cpu", max_num_batched_tokens=16, num_kv_blocks=14, block_size=8,
              max_model_len=96)
PARAMS = vx.SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=2, prompt_logprobs=2)


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(1, 400) for _ in range(20)]
    out = [[rng.randrange(1, 400) for _ in range(n)] for n in (1, 4, 13, 30, 41)]
    return out + [shared + [rng.randrange(1, 400) for _ in range(k)] for k in (0, 5, 11)]


def run(model_dir: str, on_engine: Any = None, **parallel: Any) -> tuple[list, vx.EngineStats]:
    """The outputs and stats of the workload; `on_engine(llm)` runs once the engine has started."""
    llm = vx.LLM(model_dir, **ENGINE, **parallel)
    try:
        if on_engine is not None:
            on_engine(llm)
        outs = llm.generate(prompts(), PARAMS, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
    return outs, stats


def assert_same(got: list, want: list, tol: float = 1e-5) -> None:
    """The same greedy tokens; the same top logprobs (and prompt logprobs) within `tol` (1e-5; 2e-5 for the
    mixture-of-experts families, whose experts' sums over the ranks add one more summation order)."""
    for i, (g, w) in enumerate(zip(got, want)):
        g_out, w_out = g.outputs[0], w.outputs[0]
        assert g_out.token_ids == w_out.token_ids, f"prompt {i}: {g_out.token_ids} != {w_out.token_ids}"
        for got_pos, want_pos in zip(g_out.logprobs + g.prompt_logprobs[1:], w_out.logprobs + w.prompt_logprobs[1:]):
            assert got_pos.keys() == want_pos.keys()
            for token, lp in want_pos.items():
                assert abs(got_pos[token].logprob - lp.logprob) < tol, (i, token)


def tolerance(family: str) -> float:
    """The logprob tolerance of `assert_same` for a family."""
    return 2e-5 if family in ("qwen3_moe", "mixtral") else 1e-5
