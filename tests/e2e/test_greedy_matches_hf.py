"""vx's greedy tokens equal Hugging Face `generate` token for token, in float32, for every family."""

from __future__ import annotations

import pytest
import torch
from tests.support.tiny_models import ENGINE_FAMILIES as FAMILIES
from tests.support.tiny_models import greedy_prompts

import vx

MAX_NEW = 24


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dirs) -> dict[str, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    ref = {}
    for fam in FAMILIES:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[fam], dtype=torch.float32).eval()
        outs = []
        for p in greedy_prompts():
            with torch.no_grad():
                gen = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                                     attention_mask=torch.ones(1, len(p), dtype=torch.long))
            outs.append(gen[0, len(p):].tolist())
        ref[fam] = outs
    return ref


def _run(model_dir: str, **engine_args) -> tuple[list[list[int]], vx.EngineStats]:
    llm = vx.LLM(model_dir, dtype="float32", device="cpu", **engine_args)
    params = vx.SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    outs = llm.generate(greedy_prompts(), params, use_tqdm=False)
    stats = llm.stats()
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], stats


CONFIGS = {
    "default": {},
    "chunked16": {"max_num_batched_tokens": 16},
    "no_prefix_cache": {"enable_prefix_caching": False},
    "tiny_kv_preempt": {"num_kv_blocks": 14, "block_size": 8, "max_model_len": 96},
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_equals_hf(tiny_model_dirs, hf_reference, family, config_name):
    got, stats = _run(tiny_model_dirs[family], **CONFIGS[config_name])
    want = hf_reference[family]
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"{family}/{config_name}: prompt {i} differs\n vx: {g}\n hf: {w}"
    assert stats.kv_blocks_in_use == 0
    assert stats.num_running == 0 and stats.num_waiting == 0
    if config_name == "tiny_kv_preempt":
        assert stats.num_preemptions > 0, "the KV cache was meant to be too small to avoid preemption"
    if config_name == "default":
        assert stats.prefix_cache_hit_tokens > 0, "prompts sharing a 45-token prefix should hit the cache"
    if config_name == "no_prefix_cache":
        assert stats.prefix_cache_hit_tokens == 0


def test_seeded_sampling_survives_preemption(tiny_model_dir):
    """A seeded request samples the same tokens whether or not memory pressure preempted it."""
    params = [vx.SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, max_tokens=MAX_NEW)
              for i in range(len(greedy_prompts()))]

    def run(**engine_args):
        llm = vx.LLM(tiny_model_dir, dtype="float32", device="cpu", block_size=8, max_model_len=96,
                     **engine_args)
        outs = llm.generate(greedy_prompts(), params, use_tqdm=False)
        stats = llm.stats()
        llm.shutdown()
        return [o.outputs[0].token_ids for o in outs], stats

    roomy, roomy_stats = run()
    tight, tight_stats = run(num_kv_blocks=14)
    assert roomy_stats.num_preemptions == 0 and tight_stats.num_preemptions > 0
    assert tight == roomy


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logprobs_equal_hf(tiny_model_dirs, family):
    """Every prompt token's logprob and the top-3 alternatives equal Hugging Face's log-softmax within 1e-4, with
    chunked prefill (16-token chunks) and prompts that share a cached prefix."""
    from transformers import AutoModelForCausalLM

    prompts = greedy_prompts()[3:]  # 17 to 61 tokens: across the chunks, the sliding windows and the shared prefix
    llm = vx.LLM(tiny_model_dirs[family], dtype="float32", device="cpu", max_num_batched_tokens=16)
    try:
        outs = llm.generate(prompts, vx.SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)
    finally:
        llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[family], dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        assert out.prompt_logprobs[0] is None
        for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
            assert prompt[position] in entry
            for token_id, lp in entry.items():
                assert abs(lp.logprob - want[position - 1, token_id].item()) < 1e-4, (family, position, token_id)
