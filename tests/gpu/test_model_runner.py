"""ModelRunner: one step plan in, the tokens (and logprobs) of the requests that reached their end out, checked
against Hugging Face on the same tiny model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vx.config import EngineArgs
from vx.gpu.model_runner import ModelRunner
from vx.sampling_params import SamplingParams
from vx.step import CachedRequestData, NewRequestData, SchedulerOutput

BS = 4
PROMPT = [5, 17, 99, 3, 250, 42, 8, 11, 300, 7]


@pytest.fixture(scope="module")
def config(tiny_model_dir):
    return EngineArgs(model=tiny_model_dir, dtype="float32", device="cpu", max_model_len=64, block_size=BS,
                      num_kv_blocks=40, max_num_seqs=4).create_config()


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


def make_runner(config) -> ModelRunner:
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(40)
    return runner


def plan(new=(), cached=(), finished=(), grammar=None) -> SchedulerOutput:
    num = {data.req_id: n for data, n in (*new, *cached)}
    out = SchedulerOutput(scheduled_new_reqs=[d for d, _ in new], scheduled_cached_reqs=[d for d, _ in cached],
                          num_scheduled_tokens=num, total_num_scheduled_tokens=sum(num.values()),
                          finished_req_ids=set(finished))
    if grammar is not None:
        out.grammar_req_ids, out.grammar_bitmask = grammar
    return out


def new_req(req_id: str, blocks: list[int], **params) -> NewRequestData:
    return NewRequestData(req_id=req_id, prompt_token_ids=PROMPT, sampling_params=SamplingParams(**params),
                          block_ids=blocks, num_computed_tokens=0)


def hf_greedy(hf_model, tokens: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([tokens]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
    return out[0, len(tokens):].tolist()


def test_prefill_in_chunks_then_decode_matches_hf_greedy(config, hf_model):
    runner = make_runner(config)
    blocks = [1, 2, 3, 4]
    first = runner.execute_model(plan(new=[(new_req("a", blocks, temperature=0.0), 4)]))
    assert first.req_ids == [] and first.sampled_token_ids == []  # mid-prompt: nothing to sample
    out = runner.execute_model(plan(cached=[(CachedRequestData(req_id="a", num_computed_tokens=4), 6)]))
    tokens = list(out.sampled_token_ids)
    assert out.req_ids == ["a"]
    for _ in range(3):
        computed = len(PROMPT) + len(tokens) - 1
        out = runner.execute_model(plan(cached=[(CachedRequestData(
            req_id="a", num_computed_tokens=computed, new_token_ids=[tokens[-1]]), 1)]))
        tokens += out.sampled_token_ids
    assert tokens == hf_greedy(hf_model, PROMPT, 4)


def test_two_requests_in_one_batch_get_what_each_gets_alone(config):
    together = make_runner(config).execute_model(plan(new=[
        (new_req("a", [1, 2, 3], temperature=0.0), 10),
        (NewRequestData(req_id="b", prompt_token_ids=PROMPT[:5], sampling_params=SamplingParams(temperature=0.0),
                        block_ids=[4, 5], num_computed_tokens=0), 5)]))
    alone_a = make_runner(config).execute_model(plan(new=[(new_req("a", [1, 2, 3], temperature=0.0), 10)]))
    alone_b = make_runner(config).execute_model(plan(new=[(NewRequestData(
        req_id="b", prompt_token_ids=PROMPT[:5], sampling_params=SamplingParams(temperature=0.0), block_ids=[7, 9],
        num_computed_tokens=0), 5)]))
    assert together.req_ids == ["a", "b"]
    assert together.sampled_token_ids == alone_a.sampled_token_ids + alone_b.sampled_token_ids


def test_prompt_logprobs_match_hf(config, hf_model):
    out = make_runner(config).execute_model(plan(new=[(new_req("a", [1, 2, 3], prompt_logprobs=2, logprobs=1), 10)]))
    start, prompt_logprobs = out.prompt_logprobs["a"]
    assert start == 0 and len(prompt_logprobs) == len(PROMPT) - 1
    with torch.no_grad():
        expected = hf_model(torch.tensor([PROMPT])).logits[0].log_softmax(-1)
    for position, (ids, logprobs) in enumerate(zip(prompt_logprobs.token_ids, prompt_logprobs.logprobs)):
        assert ids[0] == PROMPT[position + 1] and len(ids) == 3  # the prompt token, then the top 2
        assert logprobs == pytest.approx(expected[position, ids].tolist(), abs=1e-4)
    assert len(out.logprobs) == 1 and len(out.logprobs[0]) == 1  # the sampled token's own logprobs


def test_the_grammar_bitmask_leaves_only_the_allowed_token(config):
    vocab = config.model_config.vocab_size
    bitmask = np.zeros((1, -(-vocab // 32)), dtype=np.int32)
    bitmask[0, 123 // 32] = 1 << (123 % 32)
    out = make_runner(config).execute_model(plan(new=[(new_req("a", [1, 2, 3], temperature=1.0, seed=0), 10)],
                                                 grammar=(["a"], bitmask)))
    assert out.sampled_token_ids == [123]


def test_an_empty_step_drops_finished_requests_and_runs_nothing(config):
    runner = make_runner(config)
    runner.execute_model(plan(new=[(new_req("a", [1, 2, 3], temperature=0.0), 10)]))
    assert "a" in runner.input_batch.states
    out = runner.execute_model(plan(finished=["a"]))
    assert out.req_ids == [] and out.failed == {} and "a" not in runner.input_batch.states


def test_kv_cache_bytes_per_block(config):
    runner = make_runner(config)
    mc = config.model_config
    assert runner.kv_cache_bytes_per_block() == mc.num_layers * 2 * BS * mc.num_kv_heads * mc.head_dim * 4
    assert len(runner.kv_caches) == mc.num_layers
