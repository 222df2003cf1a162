"""AOT-compiled CPU decode graphs (vx.gpu.aoti_graphs): HF's greedy tokens, an engine process without the compiler,
the package cache and its key, and the in-process fallback."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import vx
from tests.gpu.test_decode_graphs import _hf_greedy, _prompts, _runner, _vx_greedy
from vx.gpu import aoti_graphs
from vx.gpu.aoti_graphs import AotiGraphs, _read_sidecar, sidecar_path

REPO = Path(__file__).resolve().parents[2]

# Runs an engine in its own process (sys.modules is then the engine's alone) and prints what the test checks.
_ENGINE = """
import json, sys
import vx
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


def _engine_in_process_of_its_own(model: str, cache_dir: Path, prompts, **engine_args) -> dict:
    env = dict(os.environ, VX_DECODE_COMPILE="startup", VX_CACHE_DIR=str(cache_dir), VX_DECODE_GRAPHS="aoti",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", _ENGINE, model, json.dumps(engine_args), json.dumps(prompts)],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["float", "gguf-q4_1"])
def test_aoti_graphs_give_hf_greedy_tokens_without_the_compiler_in_the_engine(tiny_model_dirs, tiny_gguf, tmp_path,
                                                                             monkeypatch, weights):
    """Every size's package is compiled by a child before serving; the engine (a process of its own) serves decode
    steps through them, gives HF's float32 greedy tokens, and never imports torch._dynamo or torch._inductor. A
    second engine of the same config reuses the packages (no child)."""
    if weights == "float":
        model, reference_dir = tiny_model_dirs["llama"], tiny_model_dirs["llama"]
    else:
        tiny = tiny_gguf("Q4_1")
        model, reference_dir = tiny.gguf_path, tiny.float_dir
    monkeypatch.setenv("VX_CPU_MATMUL", "float")  # the C kernel's exact path: HF's tokens
    prompts = _prompts(300)
    want = _hf_greedy(reference_dir, prompts)
    first = _engine_in_process_of_its_own(model, tmp_path, prompts, max_num_seqs=4)
    assert first["fallback"] is False and first["children_run"] == 3 and first["ready"] == [1, 2, 4]
    assert first["compiler"] == []
    assert first["tokens"] == want
    assert first["steps_run"].get("4", 0) > 0, first["steps_run"]  # the padded graph of 3 requests included
    again = _engine_in_process_of_its_own(model, tmp_path, prompts, max_num_seqs=4)
    assert again["children_run"] == 0 and again["key"] == first["key"] and again["fallback"] is False
    assert again["tokens"] == want and again["compiler"] == []


@pytest.mark.slow
def test_a_package_of_another_key_is_not_reused(tiny_model_dir, tmp_path):
    """A KV cache of another size bakes in other shapes: another key, a new compile, and the package under the old
    key is never read."""
    prompts = [[5, 6, 7]]
    first = _engine_in_process_of_its_own(tiny_model_dir, tmp_path, prompts, max_num_seqs=1, num_kv_blocks=80)
    other = _engine_in_process_of_its_own(tiny_model_dir, tmp_path, prompts, max_num_seqs=1, num_kv_blocks=96)
    assert first["children_run"] == 1 and other["children_run"] == 1 and other["key"] != first["key"]
    assert other["tokens"] == first["tokens"] and not other["fallback"]
    # The old key's sidecar is refused under the new key, whatever the folder.
    package = str(tmp_path / "decode-graphs" / first["key"] / "size1.pt2")
    assert _read_sidecar(package, first["key"], 1) is not None
    assert _read_sidecar(package, other["key"], 1) is None
    assert _read_sidecar(package, first["key"], 2) is None


def _tiny_aoti_engine(model: str, monkeypatch, tmp_path, caplog) -> tuple[list[list[int]], dict, AotiGraphs]:
    monkeypatch.setenv("VX_DECODE_COMPILE", "startup")
    monkeypatch.setenv("VX_DECODE_GRAPHS", "aoti")
    monkeypatch.setenv("VX_CACHE_DIR", str(tmp_path))
    llm = vx.LLM(model, dtype="float32", device="cpu", max_num_seqs=2)
    try:
        graphs = _runner(llm).decode_graphs
        outs = llm.generate([[5, 6, 7], [8, 9]], vx.SamplingParams(temperature=0.0, max_tokens=10),
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], dict(graphs.steps_run), graphs._capture
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_a_failing_child_falls_back_to_in_process_compiles(tiny_model_dir, monkeypatch, tmp_path, caplog):
    """The child exits non-zero (here: no such module): a warning, and the engine compiles in-process as before."""
    monkeypatch.setenv("VX_DECODE_COMPILE", "off")
    eager, _ = _vx_greedy(tiny_model_dir, [[5, 6, 7], [8, 9]])
    monkeypatch.setattr(aoti_graphs, "CHILD_MODULE", "vx.gpu.no_such_module")
    with caplog.at_level(logging.WARNING, logger="vx.gpu.aoti_graphs"):
        tokens, steps, capture = _tiny_aoti_engine(tiny_model_dir, monkeypatch, tmp_path, caplog)
    assert capture.using_fallback and capture.children_run == 1  # the first size's child only
    assert "compiles its decode graphs in-process instead" in caplog.text
    assert sum(steps.values()) > 0
    assert [t[:10] for t in eager] == tokens


@pytest.mark.slow
def test_a_package_whose_constants_differ_is_refused(tiny_model_dir, monkeypatch, tmp_path, caplog):
    """Loading hands the package the engine's tensors unchecked by torch: a sidecar that records another shape for
    one of them (as a stale package would) makes the load fail, and the engine falls back."""
    monkeypatch.setenv("VX_DECODE_COMPILE", "off")
    eager, _ = _vx_greedy(tiny_model_dir, [[5, 6, 7], [8, 9]])
    tokens, _, capture = _tiny_aoti_engine(tiny_model_dir, monkeypatch, tmp_path, caplog)
    assert not capture.using_fallback and [t[:10] for t in eager] == tokens
    for size in (1, 2):
        path = sidecar_path(capture.package_path(size))
        sidecar = json.loads(Path(path).read_text())
        name = next(iter(sidecar["constants"]))
        sidecar["constants"][name][1][0][0] += 1
        Path(path).write_text(json.dumps(sidecar))
    with caplog.at_level(logging.WARNING, logger="vx.gpu.aoti_graphs"):
        tokens, _, capture = _tiny_aoti_engine(tiny_model_dir, monkeypatch, tmp_path, caplog)
    assert capture.using_fallback and capture.children_run == 0
    assert "is [" in caplog.text and "in the package" in caplog.text
    assert [t[:10] for t in eager] == tokens
