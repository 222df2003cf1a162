"""vx's embeddings equal Hugging Face's (the causal LM's base model, its final hidden states pooled and L2-normalised,
float32) within 1e-5, through the same scheduler and KV cache as generation: chunked prefill, prefix caching,
preemption, and batches shared with generation requests whose tokens stay what they are alone."""

from __future__ import annotations

import collections
import json
import random
import shutil

import anyio
import pytest
import torch

import vx
from vx.client.submit import PromptRequest

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
POOLING = ("last", "mean")
TOL = 1e-5


def _prompts(vocab: int = 400) -> list[list[int]]:
    """Mixed lengths, around and across block (16) and chunk (16) boundaries, and two sharing a 40-token prefix."""
    rng = random.Random(99)
    shared = [rng.randrange(1, vocab) for _ in range(40)]
    prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in (1, 4, 15, 16, 17, 33, 70)]
    return prompts + [shared + [rng.randrange(1, vocab) for _ in range(k)] for k in (3, 21)]


def _hf_embeddings(model: torch.nn.Module, prompts: list[list[int]], pooling: str,
                   dimensions: int | None = None) -> list[torch.Tensor]:
    """The reference: the base model's last hidden state (after its final norm), pooled, cut, L2-normalised."""
    out = []
    for p in prompts:
        with torch.no_grad():
            hidden = model(torch.tensor([p])).last_hidden_state[0]
        vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
        out.append(torch.nn.functional.normalize(vector[:dimensions], dim=0))
    return out


@pytest.fixture(scope="module")
def hf_models(tiny_model_dirs) -> dict[str, torch.nn.Module]:
    from transformers import AutoModel

    return {fam: AutoModel.from_pretrained(tiny_model_dirs[fam], dtype=torch.float32).eval() for fam in FAMILIES}


def _assert_close(got: list[vx.EmbeddingRequestOutput], want: list[torch.Tensor], what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert isinstance(g, vx.EmbeddingRequestOutput) and g.finished
        vector = torch.tensor(g.outputs.embedding)
        assert vector.shape == w.shape, f"{what}: prompt {i}"
        err = (vector - w).abs().max().item()
        assert err < TOL, f"{what}: prompt {i} differs from Hugging Face by {err}"


def _llm(model_dir: str, **engine_args) -> vx.LLM:
    return vx.LLM(model_dir, dtype="float32", device="cpu", **engine_args)


def _record_steps(llm: vx.LLM) -> list:
    """Every (SchedulerOutput, ModelRunnerOutput) the in-process engine runs from now on."""
    executor = llm.llm_engine.engine_core.engine_core.executor
    steps, execute = [], executor.execute_model

    def recording(scheduler_output):
        runner_output = execute(scheduler_output)
        steps.append((scheduler_output, runner_output))
        return runner_output

    executor.execute_model = recording
    return steps


CONFIGS = {
    "default": {},
    "chunked8": {"max_num_batched_tokens": 8},  # every prompt but the shortest runs in several chunks
    "no_prefix_cache": {"enable_prefix_caching": False},
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_embeddings_equal_hf(tiny_model_dirs, hf_models, family, config_name):
    prompts = _prompts()
    with _llm(tiny_model_dirs[family], **CONFIGS[config_name]) as llm:
        for pooling in POOLING:
            got = llm.embed(prompts, vx.PoolingParams(pooling_type=pooling), use_tqdm=False)
            _assert_close(got, _hf_embeddings(hf_models[family], prompts, pooling), f"{family}/{config_name}/{pooling}")
            assert [g.prompt_token_ids for g in got] == prompts
        stats = llm.stats()
    assert stats.kv_blocks_in_use == 0 and stats.num_running == 0 and stats.num_waiting == 0
    if config_name == "chunked8":
        # 9 prompts of 1..70 tokens in chunks of 8, twice: many more steps than prompts.
        assert stats.num_steps > 2 * len(prompts)


def test_default_pooling_is_last_token_normalised(tiny_model_dir, hf_models):
    prompts = _prompts()[:3]
    with _llm(tiny_model_dir) as llm:
        got = llm.embed(prompts, use_tqdm=False)
        raw = llm.embed(prompts, vx.PoolingParams(normalize=False), use_tqdm=False)
    _assert_close(got, _hf_embeddings(hf_models["qwen3"], prompts, "last"), "default")
    for g, r in zip(got, raw):
        norm = torch.tensor(r.outputs.embedding).norm().item()
        assert abs(norm - 1.0) > 1e-3  # not normalised: the hidden state itself
        assert torch.allclose(torch.tensor(r.outputs.embedding) / norm, torch.tensor(g.outputs.embedding), atol=TOL)


@pytest.mark.parametrize("pooling", POOLING)
def test_a_second_identical_prompt_hits_the_prefix_cache_and_embeds_the_same(tiny_model_dir, hf_models, pooling):
    prompt = _prompts()[-1]  # 61 tokens: three full blocks of 16
    want = _hf_embeddings(hf_models["qwen3"], [prompt], pooling)
    params = vx.PoolingParams(pooling_type=pooling)
    with _llm(tiny_model_dir) as llm:
        first = llm.embed([prompt], params, use_tqdm=False)
        hits_before = llm.stats().prefix_cache_hit_tokens
        second = llm.embed([prompt], params, use_tqdm=False)
        hits = llm.stats().prefix_cache_hit_tokens - hits_before
    _assert_close(first + second, want * 2, pooling)
    if pooling == "last":
        assert second[0].num_cached_tokens == 48 and hits == 48  # only the last block's tokens ran again
    else:
        assert second[0].num_cached_tokens == 0 and hits == 0  # a mean needs every token's hidden state


def test_embeddings_share_batches_with_generation(tiny_model_dir, hf_models):
    """Generation and embedding requests queued together run in the same steps; each generation request's greedy
    tokens equal what it gets alone, and each embedding equals Hugging Face's."""
    prompts = _prompts()
    gen_params = vx.SamplingParams(temperature=0.0, max_tokens=12, output_kind=vx.RequestOutputKind.FINAL_ONLY)
    with _llm(tiny_model_dir, max_num_batched_tokens=24) as llm:
        alone = [o.outputs[0].token_ids for o in llm.generate(prompts, gen_params, use_tqdm=False)]
        engine = llm.llm_engine
        steps = _record_steps(llm)
        requests = [PromptRequest(f"g{i}", p, gen_params) for i, p in enumerate(prompts)]
        requests += [PromptRequest(f"{pooling}{i}", p, vx.PoolingParams(pooling_type=pooling))
                     for pooling in POOLING for i, p in enumerate(prompts)]
        random.Random(5).shuffle(requests)
        engine.add_requests(requests)
        results = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                results[out.request_id] = out
        stats = llm.stats()
    assert any(runner.pooled and runner.sampled_token_ids for _, runner in steps), "no step both pooled and sampled"
    assert [results[f"g{i}"].outputs[0].token_ids for i in range(len(prompts))] == alone
    for pooling in POOLING:
        _assert_close([results[f"{pooling}{i}"] for i in range(len(prompts))],
                      _hf_embeddings(hf_models["qwen3"], prompts, pooling), f"mixed/{pooling}")
    assert stats.kv_blocks_in_use == 0


@pytest.mark.parametrize("pooling", POOLING)
def test_embeddings_survive_preemption(tiny_model_dir, hf_models, pooling):
    """A KV cache too small for the batch preempts requests, embedding ones among them; each restarts (a mean from
    its first token) and still equals Hugging Face."""
    prompts = [p for p in _prompts() if len(p) < 70]
    gen_params = vx.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with _llm(tiny_model_dir, num_kv_blocks=14, block_size=8, max_model_len=96, max_num_batched_tokens=16) as llm:
        engine = llm.llm_engine
        steps = _record_steps(llm)
        # Interleaved, so that embedding requests are among the newest running ones, which preemption picks.
        requests = [PromptRequest(f"{kind}{i}", p, gen_params if kind == "g" else vx.PoolingParams(pooling_type=kind))
                    for i, p in enumerate(prompts) for kind in (pooling, "g")]
        engine.add_requests(requests)
        results = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
        stats = llm.stats()
    # A request scheduled as new more than once was preempted and resumed.
    admissions = collections.Counter(new.req_id for plan, _ in steps for new in plan.scheduled_new_reqs)
    resumed = sorted(rid for rid, n in admissions.items() if n > 1)
    assert any(rid.startswith(pooling) for rid in resumed), \
        f"the KV cache was meant to preempt {pooling} embedding requests; resumed: {resumed}"
    _assert_close([results[f"{pooling}{i}"] for i in range(len(prompts))],
                  _hf_embeddings(hf_models["qwen3"], prompts, pooling), f"preempted/{pooling}")
    assert stats.kv_blocks_in_use == 0


@pytest.fixture(scope="module")
def matryoshka_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny Qwen3 with `matryoshka_dimensions` in its config.json: it allows cutting embeddings to 16 or 32."""
    d = tmp_path_factory.mktemp("tiny-matryoshka")
    shutil.copytree(tiny_model_dir, d, dirs_exist_ok=True)
    config = json.loads((d / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32]
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


@pytest.mark.parametrize("pooling", POOLING)
def test_matryoshka_dimensions_cut_then_renormalise(matryoshka_dir, hf_models, pooling):
    prompts = _prompts()[:4]
    with _llm(matryoshka_dir) as llm:
        got = llm.embed(prompts, vx.PoolingParams(pooling_type=pooling, dimensions=16), use_tqdm=False)
        with pytest.raises(ValueError, match="not one of the model's matryoshka_dimensions"):
            llm.embed(prompts, vx.PoolingParams(dimensions=20), use_tqdm=False)
    _assert_close(got, _hf_embeddings(hf_models["qwen3"], prompts, pooling, dimensions=16), f"matryoshka/{pooling}")


def test_invalid_embedding_requests_raise_before_anything_runs(tiny_model_dir):
    with _llm(tiny_model_dir, max_model_len=32) as llm:
        for bad, match in [("", "empty"), ([], "No prompts"), ([[]], "empty token list"),
                           ([[5] * 33], "at most 32 tokens"), ([[600]], "outside the model's vocabulary")]:
            with pytest.raises(ValueError, match=match):
                llm.embed(bad, use_tqdm=False)
        with pytest.raises(ValueError, match="no Matryoshka"):
            llm.embed("hello", vx.PoolingParams(dimensions=8), use_tqdm=False)
        with pytest.raises(ValueError, match="pooling_type"):
            vx.PoolingParams(pooling_type="cls")
        with pytest.raises(ValueError, match="pooling_params must be PoolingParams"):
            llm.embed("hello", [vx.SamplingParams()], use_tqdm=False)  # type: ignore[list-item]
        # A prompt may fill the whole context: an embedding generates nothing.
        (full,) = llm.embed([[5] * 32], use_tqdm=False)
        assert len(full.outputs.embedding) == 64
        assert llm.stats().num_waiting == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.anyio
async def test_async_llm_embed(anyio_backend, tiny_model_dir, hf_models):
    prompts = _prompts()[:5]
    want_last = _hf_embeddings(hf_models["qwen3"], prompts, "last")
    async with vx.AsyncLLM(tiny_model_dir, dtype="float32", device="cpu", max_num_batched_tokens=16) as llm:
        one = await llm.embed(prompts[3])
        assert isinstance(one, vx.EmbeddingRequestOutput)
        many = await llm.embed(prompts, vx.PoolingParams(pooling_type="mean"), request_id="batch")
        text = await llm.embed("Hello there")
        with pytest.raises(ValueError, match="empty"):
            await llm.embed("")
        with pytest.raises(ValueError, match="pooling_params must be a vx.PoolingParams"):
            await llm.embed("hi", vx.SamplingParams())  # type: ignore[arg-type]
        # Cancelled while it runs: every prompt of the batch is aborted in the engine, its blocks freed.
        with anyio.move_on_after(0.01):
            await llm.embed([[7] * 900] * 6, vx.PoolingParams(pooling_type="mean"))
        assert llm.num_unfinished_requests == 0
        # Generation still works beside it, and nothing is left behind.
        assert (await llm.complete("Hi", vx.SamplingParams(max_tokens=3))).finished
        assert llm.num_unfinished_requests == 0
        with anyio.fail_after(30):
            while (stats := await llm.stats()).num_running or stats.num_waiting:
                await anyio.sleep(0.05)
    _assert_close([one], [want_last[3]], "async/one")
    assert [m.request_id for m in many] == [f"batch-{i}" for i in range(len(prompts))]
    _assert_close(many, _hf_embeddings(hf_models["qwen3"], prompts, "mean"), "async/many")
    assert text.prompt == "Hello there" and len(text.prompt_token_ids) > 0
    assert stats.kv_blocks_in_use == 0
