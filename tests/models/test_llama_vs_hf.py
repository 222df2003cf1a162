"""vx's models through the paged torch backend (the mla backend for DeepSeek-V2) equal Hugging Face in float32."""

from __future__ import annotations

import pytest
import torch
from tests.support.paged_attention import PagedRunner
from tests.support.tiny_models import FAMILIES

from vx.config import hf_is_mla
from vx.gpu.attention import get_attn_backend
from vx.gpu.kv_cache import bind_kv_caches

ATOL = 1e-4
NUM_BLOCKS = 64
BLOCK_SIZE = 4


def _prompts(lengths: tuple[int, ...], seed: int = 1, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def _runner(tiny, load_vx_model, dtype=torch.float32) -> PagedRunner:
    model = load_vx_model(tiny, dtype)
    backend = get_attn_backend("auto", "cpu", mla=hf_is_mla(tiny.config))
    bind_kv_caches(model, backend, NUM_BLOCKS, BLOCK_SIZE, dtype, "cpu")
    return PagedRunner(model, backend, NUM_BLOCKS, BLOCK_SIZE)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_batch_matches_hf(family, tiny_model, load_vx_model):
    tiny = tiny_model(family)
    runner = _runner(tiny, load_vx_model)
    prompts = _prompts((5, 33, 17, 1, 40))
    for i, p in enumerate(prompts):
        runner.add(str(i), p)
    out = runner.step({str(i): len(p) for i, p in enumerate(prompts)}, num_padding_tokens=3)
    for i, p in enumerate(prompts):
        ref = _hf_logits(tiny.hf_model, p)
        got = out[str(i)]
        assert got.dtype == torch.float32 and got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_and_decode_match_hf(family, tiny_model, load_vx_model):
    """Chunks continuing a cached prefix, decodes, and both mixed in one step, over shuffled blocks."""
    tiny = tiny_model(family)
    runner = _runner(tiny, load_vx_model)
    a, b, c = _prompts((10, 30, 5), seed=2)
    extra = _prompts((6, 6, 6), seed=3)  # tokens fed as if sampled, one per decode step
    for rid, p in zip("abc", (a, b, c)):
        runner.add(rid, p)
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": [], "c": []}

    def run(schedule: dict[str, int], **kw) -> None:
        for rid, logits in runner.step(schedule, **kw).items():
            got[rid].append(logits)

    run({"a": 10, "b": 8, "c": 5})                      # full prefill, first chunk, full prefill
    for rid, e in zip("ac", (extra[0], extra[2])):
        runner.append(rid, e[0])
    run({"b": 12, "a": 1, "c": 1}, num_padding_tokens=2)  # chunk with context mixed with two decodes
    for rid, e in zip("ac", (extra[0], extra[2])):
        runner.append(rid, e[1])
    run({"a": 1, "b": 10, "c": 1})                      # decodes on both sides of a chunk (non-contiguous)
    pending = {"a": iter(extra[0][2:]), "b": iter(extra[1]), "c": iter(extra[2][2:])}
    for _ in range(4):
        for rid in "abc":
            runner.append(rid, next(pending[rid]))
        run({"c": 1, "a": 1, "b": 1})                   # pure decode batch
    for rid in "abc":
        tokens = runner.reqs[rid].tokens
        assert runner.reqs[rid].num_computed == len(tokens)
        ours = torch.cat(got[rid])
        torch.testing.assert_close(ours, _hf_logits(tiny.hf_model, tokens), atol=ATOL, rtol=0)
    blocks = runner.reqs["b"].blocks
    assert blocks != sorted(blocks), "block table should be out of order for this test to mean anything"


def test_sliding_window_is_honoured(tiny_model, load_vx_model):
    """The Mistral prompt outruns its window: vx matches HF with the window and differs without it."""
    tiny = tiny_model("mistral")
    window = tiny.config.sliding_window
    prompt = _prompts((3 * window,), seed=4)[0]
    runner = _runner(tiny, load_vx_model)
    runner.add("x", prompt)
    ours = torch.cat([runner.step({"x": 2 * window})["x"]]
                     + [runner.step({"x": 1})["x"] for _ in range(window)])
    torch.testing.assert_close(ours, _hf_logits(tiny.hf_model, prompt), atol=ATOL, rtol=0)
    tiny.config.sliding_window = None
    try:
        no_window = _hf_logits(tiny.hf_model, prompt)
    finally:
        tiny.config.sliding_window = window
    assert (ours[window + 1:] - no_window[window + 1:]).abs().max() > 1e-2


def test_bfloat16_runs_close_to_float32_hf(tiny_model, load_vx_model):
    """A half-precision smoke test: the same paged path runs in bf16 and stays near the fp32 reference."""
    tiny = tiny_model("qwen3")
    runner = _runner(tiny, load_vx_model, torch.bfloat16)
    prompt = _prompts((12,), seed=5)[0]
    runner.add("x", prompt)
    first = runner.step({"x": 12})["x"]
    runner.append("x", 7)
    second = runner.step({"x": 1})["x"]
    ours = torch.cat([first, second])
    assert ours.dtype == torch.float32 and torch.isfinite(ours).all()
    ref = _hf_logits(tiny.hf_model, prompt + [7])
    assert (ours - ref).abs().max() < 0.5
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75
