"""AOT-compiled CPU decode graphs (vx.gpu.aoti_graphs): HF's greedy tokens, an engine process without the compiler,
the package cache and its key, and the in-process fallback."""

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
def test_aoti_graphs_give_hf_greedy_tokens_without_the_compiler_in_the_engine(tiny_gguf, tmp_path, monkeypatch):
    """Every size's package is compiled by a child before serving; the engine (a process of its own) serves decode
    steps through them, gives HF's float32 greedy tokens, and never imports torch._dynamo or torch._inductor. A
    second engine of the same config reuses the packages (no child). GGUF weights, as the default model's, through
    the C kernel's operator (float weights: test_decode_graphs.py, packages compiled the same way)."""
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


@pytest.fixture(scope="module")
def tiny_package(tiny_model_dir, tmp_path_factory) -> tuple[Path, dict]:
    """A cache holding the tiny model's one decode-graph package (`max_num_seqs=1`), compiled once for the tests
    that start from a compiled package (each copies it), and what the engine that compiled it reported."""
    cache = tmp_path_factory.mktemp("aoti-cache")
    return cache, _engine_in_process_of_its_own(tiny_model_dir, cache, [[5, 6, 7]], max_num_seqs=1)


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
    llm = vx.LLM(model, dtype="float32", device="cpu", max_num_seqs=1)  # one graph: each compile costs seconds
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
def test_a_package_whose_constants_differ_is_refused(tiny_model_dir, tiny_package, monkeypatch, tmp_path, caplog):
    """Loading hands the package the engine's tensors unchecked by torch: a sidecar that records another shape for
    one of them (as a stale package would) makes the load fail, and the engine falls back."""
    monkeypatch.setenv("VX_DECODE_COMPILE", "off")
    eager, _ = _vx_greedy(tiny_model_dir, [[5, 6, 7], [8, 9]])
    _copy_of(tiny_package[0], tmp_path)  # the package an engine out of process compiled: the same key
    tokens, _, capture = _tiny_aoti_engine(tiny_model_dir, monkeypatch, tmp_path, caplog)
    assert not capture.using_fallback and capture.children_run == 0 and [t[:10] for t in eager] == tokens
    for size in (1,):
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


def test_the_key_is_shared_by_engines_in_and_out_of_process_and_follows_what_the_code_bakes_in(tiny_model_dir):
    """An in-process engine keeps a transformers config, an engine process receives its resolved fields: one key
    for both (a `vx.LLM` and an `AsyncLLM` share packages). Scheduler limits and the seed change no package's code;
    the dtype, the block size or the KV-cache size do."""
    from vx.config import EngineArgs, decode_config, encode_config

    def key(config, num_blocks=64):
        return aoti_graphs.cache_key(config, num_blocks, (), 8, 2)

    config = EngineArgs(model=tiny_model_dir, dtype="float32", device="cpu").create_config()
    in_process = key(config)
    assert key(decode_config(encode_config(config))) == in_process
    same = EngineArgs(model=tiny_model_dir, dtype="float32", device="cpu", max_num_seqs=3, seed=7,
                      max_num_batched_tokens=512, grammar_compile_workers=1).create_config()
    assert key(same) == in_process
    assert key(config, num_blocks=65) != in_process
    for other in ({"dtype": "bfloat16"}, {"block_size": 32}):
        args = {"model": tiny_model_dir, "dtype": "float32", "device": "cpu", **other}
        assert key(EngineArgs(**args).create_config()) != in_process, other


_EXIT_WITHOUT_SHUTDOWN = """
import sys, time
import vx
from vx.gpu import aoti_graphs
aoti_graphs.CHILD_MODULE = "hung_compile"  # a child that never ends
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
    monkeypatch.setattr(aoti_graphs, "CHILD_MODULE", "hung_compile")
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


def test_files_left_by_a_killed_compile_are_removed_once_no_compile_could_still_own_them(tmp_path):
    """A request folder and a half-written package left by a killed engine go at the next compile under that key;
    those of a compile that may still run (younger than twice the child's time limit) stay, as do packages."""
    old_request, old_package = tmp_path / "tmp-request-x", tmp_path / "tmpab12.pt2"
    old_request.mkdir()
    (old_request / "request.json").write_text("{}")
    old_package.write_bytes(b"half")
    young = tmp_path / "tmpcd34.pt2"
    young.write_bytes(b"being written")
    package = tmp_path / "size1.pt2"
    package.write_bytes(b"whole")
    long_ago = time.time() - 2 * aoti_graphs.CHILD_TIMEOUT_S - 60
    for path in (old_request, old_package, package):
        os.utime(path, (long_ago, long_ago))
    aoti_graphs._remove_stale_files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["size1.pt2", "tmpcd34.pt2"]


def test_key_folders_unused_for_a_month_are_removed_and_a_load_marks_a_key_used(tmp_path):
    """Every upgrade of vx or torch makes new keys: folders no engine loaded from or compiled into for
    `UNUSED_KEY_DAYS` go at the next compile, the others stay."""
    root = tmp_path / "decode-graphs"
    old, recent, used = root / "old-key", root / "recent-key", root / "used-key"
    for key in (old, recent, used):
        key.mkdir(parents=True)
        (key / "size1.pt2").write_bytes(b"package")
    month = aoti_graphs.UNUSED_KEY_DAYS * 86400.0
    for key, age in ((old, month + 3600), (recent, month - 3600), (used, month + 3600)):
        os.utime(key, (time.time() - age, time.time() - age))
    aoti_graphs._mark_used(used)
    aoti_graphs._remove_unused_keys(root, month)
    assert sorted(p.name for p in root.iterdir()) == ["recent-key", "used-key"]
    assert (used / "size1.pt2").read_bytes() == b"package"
