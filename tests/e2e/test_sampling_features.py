"""Logprobs and prompt logprobs against Hugging Face, parallel sampling (n) sharing the prompt's KV blocks, and
seeded sampling that does not depend on the batch a request lands in. Tiny random Qwen3, float32, CPU."""

from __future__ import annotations

import random

import pytest
import torch

import vx
from vx.client.llm_engine import LLMEngine
from vx.config import EngineArgs

PROMPTS = [[(7 * i + 3) % 400 + 1 for i in range(n)] for n in (1, 5, 23, 40)]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = vx.LLM(tiny_model_dir, dtype="float32", device="cpu", block_size=8)
    yield engine
    engine.shutdown()


def _hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at every position of `token_ids`: [len, vocab]."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0]
    return logits.float().log_softmax(dim=-1)


def _check_position(position: dict[int, vx.Logprob], chosen: int, ref: torch.Tensor, k: int) -> None:
    """One position's logprobs: the chosen token first with its rank, then HF's top-k, all within 1e-4."""
    ids = list(position)
    assert ids[0] == chosen
    assert position[chosen].logprob == pytest.approx(ref[chosen].item(), abs=1e-4)
    assert position[chosen].rank == int((ref > ref[chosen]).sum()) + 1
    top = ref.topk(k).indices.tolist()
    assert set(top) <= set(ids) and len(ids) in (k, k + 1)  # k + 1 unless the chosen token is in the top k
    for rank, tid in enumerate(top, 1):
        assert position[tid].logprob == pytest.approx(ref[tid].item(), abs=1e-4)
        if tid != chosen:
            assert position[tid].rank == rank


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_match_hf(llm, hf_model, temperature):
    k = 4
    params = vx.SamplingParams(temperature=temperature, seed=3, max_tokens=8, ignore_eos=True, logprobs=k,
                               repetition_penalty=1.3)  # raw logprobs: the penalty must not show in them
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        c = out.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) == 8
        ref = _hf_logprobs(hf_model, prompt + c.token_ids)
        for j, (tok, position) in enumerate(zip(c.token_ids, c.logprobs)):
            _check_position(position, tok, ref[len(prompt) - 1 + j], k)
            assert position[tok].decoded_token == llm.tokenizer.decode([tok])
        assert c.cumulative_logprob == pytest.approx(sum(p[t].logprob for p, t in zip(c.logprobs, c.token_ids)),
                                                     abs=1e-4)


def test_logprobs_zero_gives_the_chosen_token_only(llm):
    out = llm.generate(PROMPTS[2], vx.SamplingParams(temperature=0, max_tokens=3, logprobs=0), use_tqdm=False)[0]
    assert [list(p) for p in out.outputs[0].logprobs] == [[t] for t in out.outputs[0].token_ids]
    plain = llm.generate(PROMPTS[2], vx.SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None
    assert plain.prompt_logprobs is None


@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 16}, {"num_kv_blocks": 9}],
                         ids=["whole", "chunked", "preempted"])
def test_prompt_logprobs_match_hf(tiny_model_dir, hf_model, engine_args):
    k = 3
    llm = vx.LLM(tiny_model_dir, dtype="float32", device="cpu", block_size=8, max_model_len=64, **engine_args)
    try:
        # The same prompt twice: the second must not take the first's cached blocks and skip its logprobs.
        prompts = PROMPTS + [PROMPTS[-1]]
        outs = llm.generate(prompts, vx.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                       prompt_logprobs=k), use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
    if "num_kv_blocks" in engine_args:
        assert stats.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        ref = _hf_logprobs(hf_model, prompt)
        for p in range(1, len(prompt)):
            _check_position(out.prompt_logprobs[p], prompt[p], ref[p - 1], k)


def test_parallel_sampling_shares_the_prompt_blocks(tiny_model_dir):
    block_size, n = 8, 4
    prompt = [random.Random(0).randrange(1, 400) for _ in range(8 * block_size + 1)]  # 8 full blocks + 1 token
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_model_dir, dtype="float32", device="cpu",
                                                   block_size=block_size))
    try:
        engine.add_request("p", prompt, vx.SamplingParams(n=n, max_tokens=6, ignore_eos=True, seed=0))
        engine.step()  # one step admits all four samples and prefills them
        stats = engine.stats()
        assert stats.num_running == n
        # Each sample holds 9 blocks (65 prompt tokens + 1); the 8 full prompt blocks are held once, by all four.
        assert stats.kv_blocks_in_use == 8 + n * 1
        assert stats.prefix_cache_hit_tokens == (n - 1) * 8 * block_size
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
        assert engine.stats().kv_blocks_in_use == 0
    finally:
        engine.shutdown()
    assert final.finished and final.request_id == "p"
    assert [c.index for c in final.outputs] == list(range(n))
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1  # the samples differ


def test_parallel_sampling_is_reproducible_with_a_seed(llm):
    params = vx.SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    a = llm.generate(PROMPTS[1:3], params, use_tqdm=False)
    b = llm.generate(PROMPTS[2], params, use_tqdm=False)
    assert [c.token_ids for c in a[1].outputs] == [c.token_ids for c in b[0].outputs]
    # Sample i is the request with seed + i.
    single = llm.generate(PROMPTS[2], params.clone(n=1, seed=12), use_tqdm=False)[0]
    assert single.outputs[0].token_ids == b[0].outputs[1].token_ids


def test_seed_is_reproducible_across_batch_compositions(llm):
    target = vx.SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS[3], target, use_tqdm=False)[0].outputs[0].token_ids
    others = [vx.SamplingParams(temperature=0, max_tokens=5), vx.SamplingParams(temperature=1.5, max_tokens=20),
              vx.SamplingParams(temperature=0.7, min_p=0.1, presence_penalty=1.0, max_tokens=9),
              vx.SamplingParams(seed=5, max_tokens=12, logprobs=2)]
    for k in range(1, len(others) + 1):
        prompts = PROMPTS[:k] + [PROMPTS[3]] + PROMPTS[k:]
        params = others[:k] + [target] + others[k:]
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert outs[k].outputs[0].token_ids == alone, f"with {k} other request(s) in the batch"


@pytest.mark.anyio
async def test_async_parallel_sampling_output_kinds_and_abort(tiny_model_dir):
    async with vx.AsyncLLM(tiny_model_dir, dtype="float32", device="cpu") as llm:
        base = vx.SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True, logprobs=1)
        final = await llm.complete(PROMPTS[2], base)
        assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]

        texts = {i: [] for i in range(3)}
        ids = {i: [] for i in range(3)}
        async for out in llm.generate(PROMPTS[2], base.clone(output_kind=vx.RequestOutputKind.DELTA)):
            for c in out.outputs:
                ids[c.index] += c.token_ids
                texts[c.index].append(c.text)
        assert [ids[i] for i in range(3)] == [c.token_ids for c in final.outputs]
        assert ["".join(texts[i]) for i in range(3)] == [c.text for c in final.outputs]

        last = None
        async for out in llm.generate(PROMPTS[2], base):  # CUMULATIVE
            last = out
        assert [c.token_ids for c in last.outputs] == [c.token_ids for c in final.outputs]
        assert [len(c.logprobs) for c in last.outputs] == [10, 10, 10]

        with pytest.raises(ValueError, match="generate"):
            async for _ in llm.stream(PROMPTS[2], base):
                pass

        async for out in llm.generate(PROMPTS[2], base.clone(max_tokens=200)):
            break  # leaving early aborts all three samples
        for _ in range(100):
            stats = await llm.stats()
            if stats.kv_blocks_in_use == 0 and stats.num_running == 0:
                break
            import anyio

            await anyio.sleep(0.02)
        assert stats.kv_blocks_in_use == 0 and stats.num_running == 0
        assert llm.output_processor.parent_requests == {} and llm.output_processor.request_states == {}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_priority_scheduling_runs_urgent_requests_first(tiny_model_dir, policy):
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_model_dir, dtype="float32", device="cpu",
                                                   max_num_seqs=1, scheduling_policy=policy))
    try:
        params = vx.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        for rid, prio in (("background", 5), ("normal", 0), ("urgent", -1)):
            engine.add_request(rid, PROMPTS[2], params, priority=prio)
        done = []
        while engine.has_unfinished_requests():
            done += [o.request_id for o in engine.step() if o.finished]
    finally:
        engine.shutdown()
    assert done == (["urgent", "normal", "background"] if policy == "priority" else ["background", "normal", "urgent"])


def test_unknown_scheduling_policy_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="scheduling_policy"):
        vx.LLM(tiny_model_dir, scheduling_policy="lifo")
