"""AOT-compiled CPU decode graphs (vx.gpu.graphs.aoti_loader): HF's greedy tokens, an engine process without the
compiler, packages reused or refused, the in-process fallback, and the compile child killed when the engine ends."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import vx
from tests.support.kernel_cache import share_kernels
from tests.support.decode_graphs import (REPO, TINY_KV_BLOCKS, aoti_engine_in_process_of_its_own, greedy_prompts,
                                         hf_greedy, runner, vx_greedy)
from vx.gpu.graphs import aoti_cache
from vx.gpu.graphs.aoti_cache import read_sidecar, sidecar_path
from vx.gpu.graphs.aoti_loader import AotiGraphs

TWO_PROMPTS = [[5, 6, 7], [8, 9]]


@pytest.fixture(scope="module")
def eager_tokens(tiny_model_dir) -> list[list[int]]:
    """The tiny model's eager greedy tokens for `TWO_PROMPTS`: what the fallback tests' engines must give."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VX_DECODE_COMPILE", "off")
        tokens, _ = vx_greedy(tiny_model_dir, TWO_PROMPTS)
    return tokens


@pytest.mark.slow
def test_aoti_graphs_give_hf_greedy_tokens_without_the_compiler_in_the_engine(tiny_gguf, tmp_path, monkeypatch):
    """Every size's package is compiled by a child before serving; the engine (a process of its own) serves decode
    steps through them, gives HF's float32 greedy tokens, and never imports torch._dynamo or torch._inductor. A
    second engine of the same config reuses the packages (no child). GGUF weights, as the default model's, through
    the C kernel's operator (float weights: test_decode_graphs.py, packages compiled the same way)."""
    tiny = tiny_gguf("Q4_1")
    model, reference_dir = tiny.gguf_path, tiny.float_dir
    monkeypatch.setenv("VX_CPU_MATMUL", "float")  # the C kernel's exact path: HF's tokens
    prompts = greedy_prompts(300)
    want = hf_greedy(reference_dir, prompts)
    first = aoti_engine_in_process_of_its_own(model, tmp_path, prompts, max_num_seqs=4)
    assert first["fallback"] is False and first["children_run"] == 3 and first["ready"] == [1, 2, 4]
    assert first["compiler"] == []
    assert first["tokens"] == want
    assert first["steps_run"].get("4", 0) > 0, first["steps_run"]  # the padded graph of 3 requests included
    _assert_says_it_compiled(first["progress"], [1, 2, 4])
    again = aoti_engine_in_process_of_its_own(model, tmp_path, prompts, max_num_seqs=4)
    assert again["children_run"] == 0 and again["key"] == first["key"] and again["fallback"] is False
    assert again["tokens"] == want and again["compiler"] == []
    assert again["progress"] == []  # everything cached: nothing to say


def _assert_says_it_compiled(lines: list[str], sizes: list[int]) -> None:
    """A start that compiles packages says so for each size, with an estimate, and again once each is ready."""
    for size in sizes:
        assert any(f"compiling the decode graph for batch size {size} of this model (first run only, ~" in x
                   for x in lines), lines
        assert any(f"the decode graph for batch size {size} is ready (compiled in " in x for x in lines), lines


def _copy_of(cache: Path, tmp_path: Path) -> Path:
    shutil.copytree(cache, tmp_path, dirs_exist_ok=True)
    return tmp_path


@pytest.mark.slow
def test_a_package_of_another_key_is_not_reused(tiny_model_dir, tiny_package, tmp_path):
    """A KV cache of another size bakes in other shapes: another key, a new compile, and the package under the old
    key is never read."""
    prompts = [[5, 6, 7]]
    cache, first = tiny_package
    _copy_of(cache, tmp_path)
    other = aoti_engine_in_process_of_its_own(tiny_model_dir, tmp_path, prompts, max_num_seqs=1, num_kv_blocks=96)
    assert first["children_run"] == 1 and other["children_run"] == 1 and other["key"] != first["key"]
    _assert_says_it_compiled(first["progress"], [1])
    _assert_says_it_compiled(other["progress"], [1])
    assert other["tokens"] == first["tokens"] and not other["fallback"]
    # The old key's sidecar is refused under the new key, whatever the folder.
    package = str(tmp_path / "decode-graphs" / first["key"] / "size1.pt2")
    assert read_sidecar(package, first["key"], 1) is not None
    assert read_sidecar(package, other["key"], 1) is None
    assert read_sidecar(package, first["key"], 2) is None


def _tiny_aoti_engine(model: str, monkeypatch, tmp_path, caplog) -> tuple[list[list[int]], dict, AotiGraphs]:
    monkeypatch.setenv("VX_DECODE_COMPILE", "startup")
    monkeypatch.setenv("VX_DECODE_GRAPHS", "aoti")
    monkeypatch.setenv("VX_CACHE_DIR", str(tmp_path))
    share_kernels(tmp_path)
    # One graph (each compile costs seconds), the key of `tiny_package`.
    llm = vx.LLM(model, dtype="float32", device="cpu", max_num_seqs=1, num_kv_blocks=TINY_KV_BLOCKS)
    try:
        graphs = runner(llm).decode_graphs
        outs = llm.generate(TWO_PROMPTS, vx.SamplingParams(temperature=0.0, max_tokens=10),
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], dict(graphs.steps_run), graphs._capture
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_a_failing_child_falls_back_to_in_process_compiles(tiny_model_dir, eager_tokens, monkeypatch, tmp_path,
                                                           caplog):
    """The child exits non-zero (here: no such module): a warning, and the engine compiles in-process as before."""
    eager = eager_tokens
    monkeypatch.setattr(aoti_cache, "CHILD_MODULE", "vx.gpu.no_such_module")
    with caplog.at_level(logging.WARNING, logger="vx.gpu.graphs.aoti_loader"):
        tokens, steps, capture = _tiny_aoti_engine(tiny_model_dir, monkeypatch, tmp_path, caplog)
    assert capture.using_fallback and capture.children_run == 1  # the first size's child only
    assert "compiles its decode graphs in-process instead" in caplog.text
    assert sum(steps.values()) > 0
    assert [t[:10] for t in eager] == tokens


@pytest.mark.slow
def test_a_package_whose_constants_differ_is_refused(tiny_model_dir, tiny_package, eager_tokens, monkeypatch, tmp_path,
                                                     caplog):
    """Loading hands the package the engine's tensors unchecked by torch: a sidecar that records another shape for
    one of them (as a stale package would) makes the load fail, and the engine falls back."""
    eager = eager_tokens
    _copy_of(tiny_package[0], tmp_path)  # the package an engine out of process compiled: the same key
    tokens, _, capture = _tiny_aoti_engine(tiny_model_dir, monkeypatch, tmp_path, caplog)
    assert not capture.using_fallback and capture.children_run == 0 and [t[:10] for t in eager] == tokens
    for size in (1,):
        path = sidecar_path(capture.package_path(size))
        sidecar = json.loads(Path(path).read_text())
        name = next(iter(sidecar["constants"]))
        sidecar["constants"][name][1][0][0] += 1
        Path(path).write_text(json.dumps(sidecar))
    with caplog.at_level(logging.WARNING, logger="vx.gpu.graphs.aoti_loader"):
        tokens, _, capture = _tiny_aoti_engine(tiny_model_dir, monkeypatch, tmp_path, caplog)
    assert capture.using_fallback and capture.children_run == 0
    assert "is [" in caplog.text and "in the package" in caplog.text
    assert [t[:10] for t in eager] == tokens


_EXIT_WITHOUT_SHUTDOWN = """
import sys, time
import vx
from vx.gpu.graphs import aoti_cache
aoti_cache.CHILD_MODULE = "hung_compile"  # a child that never ends
llm = vx.LLM(sys.argv[1], dtype="float32", device="cpu", max_num_seqs=1)
deadline = time.monotonic() + 60
while not open(sys.argv[2]).read() and time.monotonic() < deadline:  # the child has started
    time.sleep(0.1)
print("EXITING", flush=True)
"""


@pytest.mark.slow
def test_an_interpreter_that_exits_mid_compile_kills_the_child_instead_of_waiting(tiny_model_dir, tmp_path):
    """An application that never shuts its `vx.LLM` down exits while the batch-1 graph compiles in a child: the
    exit kills the child and returns at once (in-process compiles must be waited for, a child need not)."""
    pid_file = tmp_path / "child.pid"
    pid_file.write_text("")
    (tmp_path / "hung_compile.py").write_text(
        f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
    share_kernels(tmp_path / "cache")
    env = dict(os.environ, VX_DECODE_COMPILE="background", VX_CACHE_DIR=str(tmp_path / "cache"),
               VX_DECODE_GRAPHS="aoti",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", _EXIT_WITHOUT_SHUTDOWN, tiny_model_dir, str(pid_file)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "EXITING" in proc.stdout, proc.stderr[-3000:]
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def test_a_shutdown_mid_compile_kills_the_child_without_a_warning(tiny_model_dir, monkeypatch, tmp_path, caplog):
    """Shutting an engine down while its batch-1 graph compiles in a child kills the child: nothing failed, so no
    "compiling ... failed" or fallback warning (a benchmark printed one after every engine it closed)."""
    pid_file = tmp_path / "child.pid"
    pid_file.write_text("")
    (tmp_path / "hung_compile.py").write_text(
        f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("VX_DECODE_COMPILE", "background")
    monkeypatch.setenv("VX_DECODE_GRAPHS", "aoti")
    monkeypatch.setenv("VX_CACHE_DIR", str(tmp_path / "cache"))
    share_kernels(tmp_path / "cache")
    monkeypatch.setattr(aoti_cache, "CHILD_MODULE", "hung_compile")
    with caplog.at_level(logging.DEBUG, logger="vx.gpu"):
        llm = vx.LLM(tiny_model_dir, dtype="float32", device="cpu", max_num_seqs=1)
        try:
            deadline = time.monotonic() + 60
            while not pid_file.read_text() and time.monotonic() < deadline:  # the child has started
                time.sleep(0.1)
            child = int(pid_file.read_text())
        finally:
            llm.shutdown()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert not _alive(child)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "stopped: the engine shuts down" in caplog.text


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False
