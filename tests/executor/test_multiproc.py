"""The multiprocess executor end to end: a model split over worker processes (2 tensor-parallel ranks, or 2
pipeline stages; gloo on the CPU) gives exactly the greedy tokens of the whole model in one process, and the same
logprobs within 1e-5, through chunked prefill and preemption; shutdown leaves no process behind."""

from __future__ import annotations

import random

import psutil
import pytest
from tests.support.engine_processes import child_pids

import vx

MAX_NEW = 16
# 16-token prefill chunks, and a KV cache too small for the 8 prompts at once: the scheduler preempts.
ENGINE = dict(dtype="float32", device="cpu", max_num_batched_tokens=16, num_kv_blocks=14, block_size=8,
              max_model_len=96)
PARAMS = vx.SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=2, prompt_logprobs=2)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(1, 400) for _ in range(20)]
    prompts = [[rng.randrange(1, 400) for _ in range(n)] for n in (1, 4, 13, 30, 41)]
    return prompts + [shared + [rng.randrange(1, 400) for _ in range(k)] for k in (0, 5, 11)]


def _run(model_dir: str, **parallel) -> tuple[list, vx.EngineStats, list[list[str]]]:
    """The outputs, the stats, and the command lines of the processes the engine started."""
    before = child_pids()
    llm = vx.LLM(model_dir, **ENGINE, **parallel)
    try:
        workers = [psutil.Process(pid).cmdline() for pid in child_pids() - before]
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert child_pids() <= before, "shutdown left a worker process"
    return outs, stats, workers


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    """The engine families' tiny models, and a Llama with tied embeddings (its LM head on the last stage loads the
    first stage's table)."""
    from tests.support.tiny_models import make_tiny_model
    from tests.support.tiny_tokenizer import make_tiny_tokenizer

    tied = str(tmp_path_factory.mktemp("tiny-llama3_tied"))
    make_tiny_model("llama3_tied", tied, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    make_tiny_tokenizer(tied)
    return {**tiny_model_dirs, "llama3_tied": tied}


@pytest.fixture(scope="module")
def whole_model(model_dirs) -> dict[str, list]:
    """family -> the one-process engine's outputs."""
    return {family: _run(model_dirs[family])[0] for family in ("llama", "qwen3", "llama3_tied")}


def _assert_same(got: list, want: list) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = g.outputs[0], w.outputs[0]
        assert g.token_ids == w.token_ids, f"prompt {i}: {g.token_ids} != {w.token_ids}"
        for got_pos, want_pos in zip(g.logprobs + got[i].prompt_logprobs[1:],
                                     w.logprobs + want[i].prompt_logprobs[1:]):
            assert got_pos.keys() == want_pos.keys()
            for token, lp in want_pos.items():
                assert abs(got_pos[token].logprob - lp.logprob) < 1e-5, (i, token)


@pytest.mark.slow
@pytest.mark.parametrize("family, split", [("llama", "tp2"), ("llama", "pp2"), ("qwen3", "tp2"), ("qwen3", "pp2"),
                                           ("llama3_tied", "pp2")])
def test_split_model_equals_the_whole_model(model_dirs, whole_model, family, split):
    parallel = {"tp2": dict(tensor_parallel_size=2), "pp2": dict(pipeline_parallel_size=2)}[split]
    outs, stats, workers = _run(model_dirs[family], **parallel)
    # One worker process per rank, each started as its own module (not a multiprocessing spawn of this one).
    assert len(workers) == 2 and all(cmd[-2:] == ["-m", "vx.executor.worker_main"] for cmd in workers), workers
    assert stats.num_preemptions > 0, "the KV cache was meant to be too small to avoid preemption"
    assert stats.kv_blocks_in_use == 0
    _assert_same(outs, whole_model[family])
