"""AsyncLLM when its engine dies, at each moment that matters: SIGKILL while idle and in the middle of a
chunked prefill, a fault raised inside execute_model during a prefill, and the application itself killed.

(SIGKILL mid-decode is `test_async_llm.py::test_sigkill_mid_stream`; a fault inside execute_model mid-decode
is `tests/e2e/test_streaming.py`.) Each test starts its own engine, since each one kills it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import anyio
import pytest
from tests.support.engine_processes import ENGINE_KWARGS, child_pids, kill_parent_expect_engine_gone, process_gone, wait_until
from tests.support.faulty_executors import FailAfter5Steps, backend

import vx

# A 249-token prompt under a 4-token budget takes 63 steps to prefill: long enough to be caught in the middle.
LONG_PROMPT = [1 + (i * 7) % 500 for i in range(249)]
PREFILL_ENGINE = dict(ENGINE_KWARGS, max_num_batched_tokens=4)
PARAMS = vx.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


async def expect_dead_everywhere(llm: vx.AsyncLLM, match: str) -> None:
    """Every call on a dead engine fails at once with EngineDeadError."""
    t0 = time.monotonic()
    for call in (lambda: llm.complete("new", PARAMS), llm.stats, lambda: llm.abort("x")):
        with pytest.raises(vx.EngineDeadError, match=match):
            await call()
    for gen in (llm.stream("new", PARAMS), llm.generate([1, 2, 3], PARAMS)):
        with pytest.raises(vx.EngineDeadError, match=match):
            async for _ in gen:
                pass
    assert time.monotonic() - t0 < 0.5


async def stream_tokens(llm: vx.AsyncLLM, prompt, received: list[int], failures: list) -> None:
    """Consume one request, recording its tokens and the error (with its time) that ends it."""
    try:
        async for out in llm.generate(prompt, PARAMS.clone(max_tokens=100)):
            received += out.outputs[0].token_ids
    except vx.EngineDeadError as e:
        failures.append((e, time.monotonic()))


@contextlib.asynccontextmanager
async def engine_that_dies(model_dir: str, engine_kwargs: dict, *, exit_grace: float = 0.0):
    """An AsyncLLM whose engine the body kills (or makes fail); yields (llm, engine).

    After the body: leaving `async with` takes under 2 s, the engine process is gone (at once, or within
    `exit_grace` seconds for an engine that exits on its own after reporting its error), no child process and
    no ipc dir (socket files) are left, and the front end holds no per-request state.
    """
    before = child_pids()
    async with vx.AsyncLLM(model_dir, **engine_kwargs) as llm:
        engine = llm._client.engine
        pid, ipc_dir = engine.proc.pid, engine.ipc_dir
        yield llm, engine
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 2.0, "leaving `async with` took too long"
    gone = wait_until(lambda: process_gone(pid), timeout=exit_grace) if exit_grace else process_gone(pid)
    assert gone and child_pids() <= before
    assert not os.path.exists(ipc_dir)
    assert llm.output_processor.request_states == {} and llm.output_processor.queues() == []
    assert llm.output_processor.parent_requests == {}


@pytest.mark.anyio
async def test_sigkill_while_idle(tiny_model_dir):
    async with engine_that_dies(tiny_model_dir, ENGINE_KWARGS) as (llm, engine):
        assert (await llm.complete("warm", PARAMS)).finished
        assert os.path.isdir(engine.ipc_dir)
        assert not llm.errored and llm.dead_error is None
        os.kill(engine.proc.pid, signal.SIGKILL)
        with anyio.fail_after(2.0):  # the watcher notices the exit through the process sentinel
            while not llm.errored:
                await anyio.sleep(0.01)
        assert isinstance(llm.dead_error, vx.EngineDeadError) and "SIGKILL" in str(llm.dead_error)
        await expect_dead_everywhere(llm, "SIGKILL")
    assert llm.errored, "a crash stays visible after shutdown"


@pytest.mark.anyio
async def test_a_normal_shutdown_is_not_an_error(tiny_model_dir):
    async with vx.AsyncLLM(tiny_model_dir, **ENGINE_KWARGS) as llm:
        assert (await llm.complete("warm", PARAMS)).finished
        assert not llm.errored
    assert not llm.errored and llm.dead_error is None


@pytest.mark.anyio
async def test_sigkill_mid_prefill(tiny_model_dir):
    received: list[int] = []
    failures: list = []
    async with engine_that_dies(tiny_model_dir, PREFILL_ENGINE) as (llm, engine):
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream_tokens, llm, LONG_PROMPT, received, failures)
                while (await llm.stats()).num_steps < 3:  # three 4-token chunks of the prompt are done
                    await anyio.sleep(0)
                os.kill(engine.proc.pid, signal.SIGKILL)
                killed_at = time.monotonic()
        assert received == [], "the prefill had already finished: the kill came too late"
        assert len(failures) == 1
        error, failed_at = failures[0]
        assert "SIGKILL" in str(error) and failed_at - killed_at < 2.0
        await expect_dead_everywhere(llm, "SIGKILL")


@pytest.mark.anyio
async def test_fault_inside_execute_model_mid_prefill(tiny_model_dir):
    # The 6th model step raises: prefill chunk 6 of 63.
    engine_kwargs = dict(PREFILL_ENGINE, distributed_executor_backend=backend(FailAfter5Steps))
    received: list[int] = []
    failures: list = []
    async with engine_that_dies(tiny_model_dir, engine_kwargs, exit_grace=2.0) as (llm, _):
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for _ in range(2):  # one prefilling, one waiting behind it
                    tg.start_soon(stream_tokens, llm, LONG_PROMPT, received, failures)
        assert received == [] and len(failures) == 2
        for error, _ in failures:
            assert "injected failure after 5 model steps" in str(error)
            assert "Traceback" in str(error.__cause__) and "execute_model" in str(error.__cause__)
        await expect_dead_everywhere(llm, "injected failure")


_APP = textwrap.dedent("""
    import sys, tempfile, time
    import anyio, vx

    async def main():
        async with vx.AsyncLLM(sys.argv[1], dtype="float32", device="cpu", num_kv_blocks=64,
                               max_model_len=128) as llm:
            async for _ in llm.stream("hello", vx.SamplingParams(max_tokens=2, ignore_eos=True)):
                pass
            print(llm._client.engine.proc.pid, flush=True)
            await anyio.sleep(600)

    if __name__ == "__main__":
        tempfile.tempdir = sys.argv[2]  # the ipc dir goes where the test can look for it
        anyio.run(main)
""")


def test_engine_exits_when_the_application_dies(tiny_model_dir, tmp_path):
    script = tmp_path / "app.py"
    script.write_text(_APP)
    ipc_root = tmp_path / "ipc"
    ipc_root.mkdir()
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    app = subprocess.Popen([sys.executable, str(script), tiny_model_dir, str(ipc_root)],
                           stdout=subprocess.PIPE, text=True, env=env)
    kill_parent_expect_engine_gone(app, str(ipc_root))
