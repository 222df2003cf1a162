"""The engine process launched as its own module (vx/client/engine_child.py, vx/core/engine_main.py): applications
without a `__main__` guard (a script, `python -`, `python -c`) stream answers, the application's import path and
output reach the engine, and the engine exits when the application dies even if a fork of it lives on."""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
from tests.support.engine_processes import ENGINE_KWARGS, kill_parent_expect_engine_gone
from tests.support.hostile_models import truncate_weights
from tests.support.kernel_cache import share_kernels_except

# No `if __name__ == "__main__":` anywhere: with a multiprocessing spawn the engine process re-imported this
# module (or could not find `<stdin>`) and failed to start.
_UNGUARDED = textwrap.dedent("""
    import json
    import sys
    import anyio
    import vx

    MODEL, KWARGS = sys.argv[1], json.loads(sys.argv[2])
    PARAMS = vx.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def main():
        async with vx.AsyncLLM(MODEL, **KWARGS) as llm:
            deltas = [tok async for tok in llm.stream("hello", PARAMS)]
        print("stream", len(deltas), repr("".join(deltas)), flush=True)

    anyio.run(main)
    llm = vx.LLM(MODEL, multiprocess=True, **KWARGS)
    try:
        out = llm.generate(["hello"], PARAMS, use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    print("llm", len(out.token_ids), repr(out.text), flush=True)
""")


def _env() -> dict[str, str]:
    return dict(os.environ, TOKENIZERS_PARALLELISM="false")


@pytest.mark.parametrize("how", ["script", "stdin", "dash_c"])
def test_an_unguarded_application_streams_an_answer(how, tiny_model_dir, tmp_path):
    args = [tiny_model_dir, json.dumps(ENGINE_KWARGS)]
    stdin = None
    if how == "script":
        script = tmp_path / "app.py"
        script.write_text(_UNGUARDED)
        cmd = [sys.executable, str(script), *args]
    elif how == "stdin":
        cmd, stdin = [sys.executable, "-", *args], _UNGUARDED
    else:
        cmd = [sys.executable, "-c", _UNGUARDED, *args]
    res = subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["stream", "llm"], res.stdout
    streamed_text, llm_text = (ast.literal_eval(line.split(maxsplit=2)[2]) for line in lines)
    assert int(lines[0].split()[1]) >= 1 and int(lines[1].split()[1]) == 6
    assert streamed_text == llm_text  # greedy: both clients got the same answer from their engines


_PLUGIN = textwrap.dedent("""
    from vx.executor import UniProcExecutor

    class CountingExecutor(UniProcExecutor):
        def execute_model(self, scheduler_output):
            print("plugin executor ran", flush=True)  # the engine's stdout is the application's
            return super().execute_model(scheduler_output)
""")


def test_the_engine_imports_from_the_applications_sys_path(tiny_model_dir, tmp_path):
    """A backend the application made importable at run time (not through PYTHONPATH) loads in the engine."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "vx_test_plugin.py").write_text(_PLUGIN)
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(plugins)!r})
        import vx
        llm = vx.LLM({tiny_model_dir!r}, multiprocess=True, distributed_executor_backend="vx_test_plugin:CountingExecutor",
                     **{ENGINE_KWARGS!r})
        llm.generate(["hi"], vx.SamplingParams(max_tokens=2), use_tqdm=False)
        llm.shutdown()
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd="/",
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "plugin executor ran" in res.stdout


def test_a_start_up_failure_is_printed_on_the_applications_stderr(tiny_model_dir, tmp_path):
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    truncate_weights(str(broken / "model.safetensors"))  # only the engine finds out
    code = textwrap.dedent(f"""
        import vx
        try:
            vx.LLM({str(broken)!r}, multiprocess=True, **{ENGINE_KWARGS!r})
        except vx.EngineDeadError as e:
            print("failed:", e, flush=True)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("failed: The vx engine failed to start"), res.stdout
    assert "__main__" not in res.stdout  # no advice about entry-point guards any more
    assert "vx engine failed to start" in res.stderr  # logged by the engine, on the stderr it inherited


def test_a_first_start_says_what_it_builds_and_a_cached_start_says_nothing(tiny_gguf, tmp_path):
    """The engine process tells the application's stderr that it builds vx's C kernels for this machine (here the one
    library its cache lacks) and when it is done; the next start, everything cached, prints neither line."""
    cache = tmp_path / "cache"
    share_kernels_except(cache, {"gguf_panels"})
    code = textwrap.dedent(f"""
        import vx
        vx.LLM({tiny_gguf("Q8_0").gguf_path!r}, multiprocess=True, **{ENGINE_KWARGS!r}).shutdown()
    """)
    env = dict(_env(), VX_CACHE_DIR=str(cache))
    first, second = (subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                    timeout=300) for _ in range(2))
    assert first.returncode == 0 and second.returncode == 0, first.stderr[-3000:] + second.stderr[-3000:]
    assert "vx: building vx's CPU kernels for this machine (first run only: 1 C library)" in first.stderr
    assert "vx: CPU kernels built in" in first.stderr
    assert "CPU kernels" not in second.stderr, second.stderr


# The application forks a child that lives on (holding a copy of the engine's stdin pipe, so no end-of-file
# reaches the engine when the application dies): the engine still notices that its parent is gone.
_FORKING_APP = textwrap.dedent("""
    import json, os, sys, tempfile, time
    import vx

    tempfile.tempdir = sys.argv[2]  # the ipc dir goes where the test can look for it
    llm = vx.LLM(sys.argv[1], multiprocess=True, **json.loads(sys.argv[3]))
    llm.generate(["hello"], vx.SamplingParams(max_tokens=2), use_tqdm=False)
    sleeper = os.fork()
    if sleeper == 0:
        time.sleep(120)
        os._exit(0)
    with open(sys.argv[4], "w") as f:
        f.write(str(sleeper))
    print(llm.llm_engine.engine_core.engine.proc.pid, flush=True)
    time.sleep(600)
""")


def test_the_engine_exits_when_the_application_dies_despite_a_fork(tiny_model_dir, tmp_path):
    ipc_root, sleeper_file = tmp_path / "ipc", tmp_path / "sleeper.pid"
    ipc_root.mkdir()
    app = subprocess.Popen([sys.executable, "-", tiny_model_dir, str(ipc_root), json.dumps(ENGINE_KWARGS),
                            str(sleeper_file)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
    try:
        app.stdin.write(_FORKING_APP)
        app.stdin.close()
        kill_parent_expect_engine_gone(app, str(ipc_root))
    finally:
        if sleeper_file.exists():
            os.kill(int(sleeper_file.read_text()), signal.SIGKILL)
