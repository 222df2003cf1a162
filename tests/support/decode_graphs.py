"""Engines with decode graphs, for the tests of vx.gpu.graphs: the prompts they run, Hugging Face's greedy tokens
for them, vx's greedy tokens in this process or in an engine process of its own (whose `sys.modules` is then the
engine's alone)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import torch

from tests.support.kernel_cache import share_kernels
import vx

MAX_NEW = 20
# The KV cache of the tiny model's engines whose graphs share one package cache key (one 1024-token sequence, plus
# the null block): the key holds the KV cache's size, and an engine's default size follows `max_num_seqs`.
TINY_KV_BLOCKS = 65
REPO = Path(__file__).resolve().parents[2]


def greedy_prompts(vocab: int) -> list[list[int]]:
    """Seven prompts within `vocab`: lengths 1 to 30, and three sharing a 20-token prefix."""
    rng = random.Random(7)
    shared = [rng.randrange(1, vocab) for _ in range(20)]
    out = [[rng.randrange(1, vocab) for _ in range(n)] for n in (1, 5, 12, 30)]
    return out + [shared + [rng.randrange(1, vocab) for _ in range(k)] for k in (3, 9)] + [list(shared)]


def hf_greedy(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    """Hugging Face's float32 greedy tokens, `MAX_NEW` a prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        with torch.no_grad():
            gen = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long))
        outs.append(gen[0, len(p):].tolist())
    return outs


def runner(llm: vx.LLM):
    """The model runner of an in-process `vx.LLM`."""
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner


def vx_greedy(model: str, prompts: list[list[int]], preemptions: list[int] | None = None,
              **engine_args) -> tuple[list[list[int]], dict[int, int]]:
    """Greedy tokens and the decode steps each graph size served; the scheduler's preemptions appended to
    `preemptions` if given."""
    llm = vx.LLM(model, dtype="float32", device="cpu", max_num_seqs=4, **engine_args)
    try:
        outs = llm.generate(prompts, vx.SamplingParams(temperature=0.0, max_tokens=MAX_NEW), use_tqdm=False)
        graphs = runner(llm).decode_graphs
        if preemptions is not None:
            preemptions.append(llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions)
        return [o.outputs[0].token_ids for o in outs], {} if graphs is None else dict(graphs.steps_run)
    finally:
        llm.shutdown()


# Runs an engine in its own process and prints what the tests check.
_ENGINE = """
import json, sys
import vx
from vx.progress import show_progress
show_progress()  # as vx's engine process does: the result carries its lines
engine_args = json.loads(sys.argv[2])
llm = vx.LLM(sys.argv[1], dtype="float32", device="cpu", **engine_args)
runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
graphs = runner.decode_graphs
prompts = json.loads(sys.argv[3])
outs = llm.generate(prompts, vx.SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
print("RESULT " + json.dumps({
    "tokens": [o.outputs[0].token_ids for o in outs], "steps_run": graphs.steps_run,
    "ready": graphs.ready_sizes, "fallback": graphs._capture.using_fallback,
    "children_run": graphs._capture.children_run, "key": graphs._capture.key,
    "compiler": [m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules]}))
llm.shutdown()
"""


def aoti_engine_in_process_of_its_own(model: str, cache_dir: Path, prompts, **engine_args) -> dict:
    """What an engine process with AOT-compiled graphs (all built at start-up, cached in `cache_dir`) reports after
    serving `prompts` greedily: tokens, steps per size, ready sizes, fallback, children run, key, compiler modules,
    and the progress lines it printed."""
    share_kernels(cache_dir)
    env = dict(os.environ, VX_DECODE_COMPILE="startup", VX_CACHE_DIR=str(cache_dir), VX_DECODE_GRAPHS="aoti",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", _ENGINE, model, json.dumps(engine_args), json.dumps(prompts)],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return {**json.loads(line[len("RESULT "):]),
            "progress": [x for x in proc.stderr.splitlines() if x.startswith("vx: ")]}
