"""The Ray executor end to end, on a local Ray cluster this module starts and stops: 2 tensor-parallel ranks as
Ray actors give exactly the whole model's greedy tokens (logprobs within 1e-5) through chunked prefill and
preemption, and leave no actor behind; a SIGKILLed actor mid-stream ends every stream with EngineDeadError within
2 s, and no actor is left."""

from __future__ import annotations

import os
import signal
import time

import anyio
import psutil
import pytest
from tests.support.engine_processes import ENGINE_KWARGS, process_gone, wait_until
from tests.support.parallel_runs import assert_same, run, tolerance

import vx

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_address():
    """A local Ray cluster of 2 CPUs for this module: its address."""
    context = ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        yield context.address_info["address"]
    finally:
        ray.shutdown()


def _ray_workers() -> list[int]:
    """Pids of the live processes of vx's Ray actors (Ray titles an actor's process `ray::RayWorker`)."""
    pids = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd and cmd[0].startswith("ray::RayWorker") and p.status() != psutil.STATUS_ZOMBIE:
            pids.append(p.pid)
    return pids


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_tensor_parallel_ranks_as_ray_actors_equal_the_whole_model(ray_address, model_dirs, whole_model, family):
    actors: list[int] = []

    def record_actors(llm) -> None:
        executor = llm.llm_engine.engine_core.engine_core.executor
        actors.extend(executor.actor_pids)

    outs, stats = run(model_dirs[family], on_engine=record_actors, tensor_parallel_size=2,
                      distributed_executor_backend="ray")
    assert len(actors) == 2
    assert stats.num_preemptions > 0
    assert_same(outs, whole_model(family), tolerance(family))
    assert wait_until(lambda: all(process_gone(pid) for pid in actors), timeout=5.0), "a Ray actor was left"


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_sigkill_of_a_ray_actor_mid_stream_fails_every_stream(ray_address, model_dirs, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", ray_address)  # the engine process joins this module's cluster
    params = vx.SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    received = [0] * 4
    failed_at: list[float] = []

    async def stream(i: int) -> None:
        try:
            async for out in llm.generate([5 + i, 9, 13 + i, 2], params):
                received[i] += len(out.outputs[0].token_ids)
        except vx.EngineDeadError:
            failed_at.append(time.monotonic())

    async with vx.AsyncLLM(model_dirs["llama"], **ENGINE_KWARGS, tensor_parallel_size=2,
                           distributed_executor_backend="ray") as llm:
        engine_pid = llm._client.engine.proc.pid
        actors = _ray_workers()
        assert len(actors) == 2
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(len(received)):
                    tg.start_soon(stream, i)
                while min(received) < 3:
                    await anyio.sleep(0.01)
                os.kill(actors[1], signal.SIGKILL)
                killed_at = time.monotonic()
        assert len(failed_at) == len(received) and max(failed_at) - killed_at < 2.0
        with pytest.raises(vx.EngineDeadError, match="Ray worker rank"):
            await llm.complete("after", params)
    assert wait_until(lambda: process_gone(engine_pid) and not _ray_workers(), timeout=5.0), "a process was left"


def test_ray_actors_end_when_their_engine_is_killed(ray_address, model_dirs, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", ray_address)
    before = {p.pid for p in psutil.Process().children()}
    llm = vx.LLM(model_dirs["llama"], multiprocess=True, **ENGINE_KWARGS, tensor_parallel_size=2,
                 distributed_executor_backend="ray")
    try:
        [engine_pid] = {p.pid for p in psutil.Process().children()} - before
        assert len(_ray_workers()) == 2
        os.kill(engine_pid, signal.SIGKILL)
        assert wait_until(lambda: not _ray_workers(), timeout=5.0), "a Ray actor outlived its engine"
    finally:
        llm.shutdown()
