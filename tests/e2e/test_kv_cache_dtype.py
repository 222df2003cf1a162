"""kv_cache_dtype end to end: a quantized KV cache holds 2x (bf16 model) / 4x (float32 model) the blocks of the same
memory budget, and greedy generation keeps the float cache's tokens except at near-ties.

Why not every prompt agrees: an 8-bit cache rounds every cached key and value (fp8 e4m3 to 3 mantissa bits, ~2.8%
rms; int8 to its row's absmax / 127, ~0.6% rms), which moves each next-token log-probability a little (measured
maxima: 0.30 nats fp8 / 0.07 int8 on the tiny model, 0.29 / 0.15 on the default model). Where the float cache's top
two tokens are closer than twice that, greedy may take the other one, and the generations part from there. Measured
here over 16 tokens: the tiny random model predicts flatly (median top-1 log-probability about -2, top-2 gaps often
under 0.1 nats), so fp8 keeps 2 of its 8 generations whole and int8 7; the default model answering 8 questions keeps
4 with fp8 (the others part after 2-10 tokens, at gaps of 0.01-0.2 nats, still answering) and all 8 with int8. A wrong
scale, block or slot moves log-probabilities by far more than these bounds.
"""

from __future__ import annotations

import json
import os
import random

import pytest

import vx

BUDGET = 2**20  # KV-cache bytes: 64 float32 blocks of the tiny model, the same budget for every kv_cache_dtype
# The most a quantized cache may move the log-probability of a token on a shared prefix: twice the measured maxima
# (above); a generation may part only where the float cache's top-2 gap is below twice this.
MAX_SHIFT = {"fp8_e4m3": 0.6, "int8": 0.3}


def _tiny_prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(1, 400) for _ in range(n)] for n in (1, 5, 17, 40, 64, 9, 33, 100)]


# The first answer is checked for "Paris": asked bare, the default model's first token is a near tie ("The" leads "L"
# by 0.08 nats, and int8 activations or a quantized cache flip it), so the question asks for a sentence.
QUESTIONS = ["What is the capital of France? Answer in one sentence.", "How many legs does a spider have?",
             "What color is the sky on a clear day?", "Name the largest planet in the solar system.",
             "What is 2 plus 2?", "Who wrote Romeo and Juliet?", "What language is spoken in Brazil?",
             "What is the boiling point of water in Celsius?"]


def _generate(model: str, kv_cache_dtype: str, prompts: list, max_tokens: int, **engine_args):
    """(completions, usable KV blocks) of greedy generation with log-probabilities of the top 2 tokens."""
    llm = vx.LLM(model, dtype="float32", kv_cache_dtype=kv_cache_dtype, **engine_args)
    try:
        if prompts and isinstance(prompts[0], str):
            prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                         add_generation_prompt=True) for p in prompts]
        params = vx.SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, ignore_eos=True)
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return outs, llm.stats().kv_blocks_total
    finally:
        llm.shutdown()


def _agreement(ref: list, got: list, max_shift: float) -> int:
    """Prompts whose tokens agree; asserts that the others part at a near-tie, after small shifts only."""
    agree = 0
    for a, b in zip(ref, got):
        part = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        for j in range(len(a.token_ids) if part is None else part):
            tok = a.token_ids[j]
            shift = abs(a.logprobs[j][tok].logprob - b.logprobs[j][tok].logprob)
            assert shift <= max_shift, f"token {j}: log-probability moved by {shift:.3f}"
        if part is None:
            agree += 1
            continue
        top2 = sorted((lp.logprob for lp in a.logprobs[part].values()), reverse=True)[:2]
        assert top2[0] - top2[1] < 2 * max_shift, f"parted at token {part} with a top-2 gap of {top2[0] - top2[1]:.3f}"
    return agree


@pytest.fixture(scope="module")
def tiny_runs(tiny_model_dir) -> dict[str, tuple[list, int]]:
    return {kv: _generate(tiny_model_dir, kv, _tiny_prompts(), 16, max_num_batched_tokens=32,
                          kv_cache_memory_bytes=BUDGET, max_model_len=256)
            for kv in ("auto", "fp8_e4m3", "int8")}


def test_the_same_budget_holds_more_blocks(tiny_runs, tiny_model_dir):
    with open(os.path.join(tiny_model_dir, "config.json")) as f:
        cfg = json.load(f)
    # One block of 16 tokens: keys and values of every layer and kv head.
    rows = cfg["num_hidden_layers"] * 2 * 16 * cfg["num_key_value_heads"]
    head_dim = cfg["head_dim"]
    row_bytes = {"auto": 4 * head_dim, "fp8_e4m3": head_dim, "int8": head_dim + 4}  # int8: codes, float32 scale
    blocks = {kv: n + 1 for kv, (_, n) in tiny_runs.items()}  # + the reserved null block
    assert blocks == {kv: BUDGET // (rows * b) for kv, b in row_bytes.items()}
    assert blocks["fp8_e4m3"] == 4 * blocks["auto"]  # float32 model: 4 bytes -> 1
    # A bfloat16 model: fp8 halves the bytes of a block, so the same budget holds twice the blocks.
    bf16 = {}
    for kv in ("auto", "fp8_e4m3"):
        llm = vx.LLM(tiny_model_dir, dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory_bytes=BUDGET,
                     max_model_len=256)
        bf16[kv] = llm.stats().kv_blocks_total + 1
        llm.shutdown()
    assert bf16["auto"] == 2 * blocks["auto"] and bf16["fp8_e4m3"] == 2 * bf16["auto"]


@pytest.mark.parametrize("kv_cache_dtype,at_least", [("fp8_e4m3", 1), ("int8", 6)])
def test_tiny_model_greedy_parts_only_at_near_ties(tiny_runs, kv_cache_dtype, at_least):
    ref, _ = tiny_runs["auto"]
    got, _ = tiny_runs[kv_cache_dtype]
    assert _agreement(ref, got, MAX_SHIFT[kv_cache_dtype]) >= at_least


@pytest.fixture(scope="module")
def default_runs(default_model_dir) -> dict[str, list]:
    # The cache's effect alone: the matmuls on the exact float path (int8 activations, VX_CPU_MATMUL=auto on VNNI
    # CPUs, move log-probabilities too, and the agreement counts below were measured without them).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VX_CPU_MATMUL", "float")
        return {kv: _generate(default_model_dir, kv, QUESTIONS, 16, max_model_len=512,
                              kv_cache_memory_bytes=2**26)[0] for kv in ("auto", "fp8_e4m3", "int8")}


@pytest.mark.parametrize("kv_cache_dtype,at_least", [("fp8_e4m3", 3), ("int8", 7)])
def test_default_model_keeps_its_answers(default_runs, kv_cache_dtype, at_least):
    assert "Paris" in default_runs[kv_cache_dtype][0].text
    assert _agreement(default_runs["auto"], default_runs[kv_cache_dtype], MAX_SHIFT[kv_cache_dtype]) >= at_least


def test_a_cache_no_backend_can_hold_is_refused_at_start(tmp_path):
    """int8 rows keep a float32 scale after head_dim codes: heads of 30 would misalign it, so the engine refuses."""
    from tests.support.tiny_models import make_tiny_model
    from tests.support.tiny_tokenizer import make_tiny_tokenizer

    model = make_tiny_model("qwen3", tmp_path, head_dim=30)
    make_tiny_tokenizer(model)
    with pytest.raises(ValueError, match="int8 KV cache needs head_dim divisible by 4, got 30"):
        vx.LLM(model, dtype="float32", kv_cache_dtype="int8", max_model_len=64)
    llm = vx.LLM(model, dtype="float32", kv_cache_dtype="fp8_e4m3", max_model_len=64)  # fp8 rows have no scale
    assert len(llm.generate([[1, 2, 3]], vx.SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2
    llm.shutdown()
