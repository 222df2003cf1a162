"""Models with sliding-window layers keep, in those layers, only the blocks their window reads (the hybrid KV cache:
one pool per attention kind), while full-attention layers keep the whole context; tokens stay Hugging Face's."""

from __future__ import annotations

import pytest

import vx

WINDOW = 8  # the tiny Gemma 2's (tests/support/tiny_models.py)
BLOCK = 4


def _run_stepwise(llm: vx.LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], list[tuple[int, ...]]]:
    """Generate step by step; the blocks in use of each group's pool after every step."""
    engine = llm.llm_engine
    kv = engine.engine_core.engine_core.kv_cache_manager
    engine.add_request("long", prompt, vx.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    held, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
        held.append(tuple(pool.get_num_in_use_blocks() for pool in kv.pools))
    return tokens, held


@pytest.mark.parametrize("chunk", [8, 64])
def test_gemma2_sliding_layers_hold_their_window_and_full_layers_the_context(tiny_model_dirs, chunk):
    """A prompt of 8 windows, prefilled in chunks of `chunk` tokens, then 8 tokens decoded."""
    llm = vx.LLM(tiny_model_dirs["gemma2"], dtype="float32", device="cpu", block_size=BLOCK,
                 max_num_batched_tokens=chunk)
    try:
        kv = llm.llm_engine.engine_core.engine_core.kv_cache_manager
        assert [g.sliding_window for g in kv.hybrid.groups] == [None, WINDOW]
        prompt = [3 + (7 * i) % 400 for i in range(8 * WINDOW)]
        tokens, held = _run_stepwise(llm, prompt, 8)
        full = [f for f, _ in held]
        sliding = [s for _, s in held]
        context = len(prompt) + 8
        # The full layers hold every block of the context (their last step: the whole context but the last token).
        assert max(full) == -(-(context - 1) // BLOCK)
        # The sliding layers: the window's blocks before the chunk computed, and the chunk's.
        bound = -(-(WINDOW - 1) // BLOCK) + 1 + -(-chunk // BLOCK)
        assert max(sliding) <= bound, (max(sliding), bound)
        # Decoding (the steps before the last, which ends the request and frees everything): the window's blocks
        # and the new token's, while the full layers hold the whole context.
        assert max(sliding[-7:-1]) <= -(-(WINDOW - 1) // BLOCK) + 2 and min(full[-7:-1]) >= len(prompt) // BLOCK
        assert held[-1] == (0, 0)
        assert kv.stats().num_blocks_in_use == 0  # the request ended: nothing held in either pool
    finally:
        llm.shutdown()
    # The same tokens as a run whose cache is never short (prefix caching off: every block computed afresh).
    reference = vx.LLM(tiny_model_dirs["gemma2"], dtype="float32", device="cpu", enable_prefix_caching=False)
    try:
        want = reference.generate([prompt], vx.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                  use_tqdm=False)[0].outputs[0].token_ids
    finally:
        reference.shutdown()
    assert tokens == list(want)
