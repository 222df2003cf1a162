"""ModelRunner: one step plan in, the tokens (and logprobs) of the requests that reached their end out, checked
against Hugging Face on the same tiny model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vx.config import EngineArgs
from vx.gpu.model_runner import ModelRunner
from vx.pooling_params import PoolingParams
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
                          block_ids=[blocks], num_computed_tokens=0)


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
                        block_ids=[[4, 5]], num_computed_tokens=0), 5)]))
    alone_a = make_runner(config).execute_model(plan(new=[(new_req("a", [1, 2, 3], temperature=0.0), 10)]))
    alone_b = make_runner(config).execute_model(plan(new=[(NewRequestData(
        req_id="b", prompt_token_ids=PROMPT[:5], sampling_params=SamplingParams(temperature=0.0), block_ids=[[7, 9]],
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


def test_mla_kv_cache_holds_one_latent_row_per_token(tiny_model_dirs):
    """A DeepSeek-V2 model's cache: per token per layer kv_lora_rank + qk_rope_head_dim values in the model dtype, not
    num_heads keys and values; what the runner allocates is what the sizing counted."""
    config = EngineArgs(model=tiny_model_dirs["deepseek_v2"], dtype="float32", device="cpu", max_model_len=64,
                        block_size=BS, num_kv_blocks=40, max_num_seqs=4).create_config()
    runner = make_runner(config)
    hf = config.model_config.hf_config
    row_bytes = (hf.kv_lora_rank + hf.qk_rope_head_dim) * 4  # float32
    assert runner.attn_backend.get_name() == "mla"
    assert runner.kv_cache_bytes_per_block() == hf.num_hidden_layers * BS * row_bytes
    assert len(runner.kv_caches) == hf.num_hidden_layers
    for cache in runner.kv_caches:
        assert cache.numel() * cache.element_size() == 40 * BS * row_bytes
    full_kv = 2 * hf.num_attention_heads * (hf.qk_nope_head_dim + hf.qk_rope_head_dim) * 4
    assert row_bytes < full_kv / 4  # 192 bytes a token and layer instead of 1,024


# ----------------------------------------------------------------------------------------------- pooling requests
@pytest.fixture(scope="module")
def hf_hidden(hf_model) -> torch.Tensor:
    """Hugging Face's final hidden states (after the last norm) of PROMPT [len, hidden]."""
    with torch.no_grad():
        return hf_model.model(torch.tensor([PROMPT])).last_hidden_state[0]


def pooling_req(req_id: str, blocks: list[int], **params) -> NewRequestData:
    return NewRequestData(req_id=req_id, prompt_token_ids=PROMPT, sampling_params=SamplingParams(max_tokens=1),
                          block_ids=[blocks], num_computed_tokens=0, pooling_params=PoolingParams(**params))


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_pooling_in_chunks_equals_hf_and_samples_nothing(config, hf_hidden, pooling_type):
    runner = make_runner(config)
    first = runner.execute_model(plan(new=[(pooling_req("p", [1, 2, 3], pooling_type=pooling_type), 3)]))
    assert first.pooled is None and first.req_ids == []  # mid-prompt: nothing to pool yet
    second = runner.execute_model(plan(cached=[(CachedRequestData(req_id="p", num_computed_tokens=3), 4)]))
    assert second.pooled is None
    last = runner.execute_model(plan(cached=[(CachedRequestData(req_id="p", num_computed_tokens=7), 3)]))
    assert last.req_ids == [] and last.sampled_token_ids == []
    want = hf_hidden[-1] if pooling_type == "last" else hf_hidden.mean(dim=0)
    got = torch.tensor(last.pooled["p"])
    assert torch.allclose(got, torch.nn.functional.normalize(want, dim=0), atol=1e-5)


def test_pooling_and_sampling_rows_share_a_batch(config, hf_hidden):
    runner = make_runner(config)
    out = runner.execute_model(plan(new=[(new_req("a", [1, 2, 3], temperature=0.0), 10),
                                         (pooling_req("p", [4, 5, 6], normalize=False), 10)]))
    alone = make_runner(config).execute_model(plan(new=[(new_req("a", [1, 2, 3], temperature=0.0), 10)]))
    assert out.req_ids == ["a"] and out.sampled_token_ids == alone.sampled_token_ids
    assert torch.allclose(torch.tensor(out.pooled["p"]), hf_hidden[-1], atol=1e-5)  # not normalised
    assert runner.input_batch.pooling_req_ids == {"p"}
    runner.execute_model(plan(finished=["p"]))
    assert runner.input_batch.pooling_req_ids == set()


def test_dimensions_cut_before_normalising(config, hf_hidden):
    out = make_runner(config).execute_model(plan(new=[(pooling_req("p", [1, 2, 3], pooling_type="mean",
                                                                   dimensions=16), 10)]))
    want = torch.nn.functional.normalize(hf_hidden.mean(dim=0)[:16], dim=0)
    assert torch.allclose(torch.tensor(out.pooled["p"]), want, atol=1e-5)


def test_steps_without_pooling_requests_do_no_pooling_work(config, monkeypatch):
    import vx.gpu.model_runner as model_runner

    def refuse(*args, **kwargs):
        raise AssertionError("pool_step ran in a step without pooling requests")

    monkeypatch.setattr(model_runner, "pool_step", refuse)
    runner = make_runner(config)
    out = runner.execute_model(plan(new=[(new_req("a", [1, 2, 3], temperature=0.0), 10)]))
    assert out.pooled is None and out.req_ids == ["a"]
    assert runner.input_batch.pooling_req_ids == set()
