"""A model split over worker processes fails cleanly: a worker killed (SIGKILL) or raising in its forward in the
middle of the streams ends every stream with EngineDeadError within 2 s and leaves no process behind (psutil); a
worker whose engine dies exits by itself."""

from __future__ import annotations

import os
import signal
import time

import anyio
import psutil
import pytest
from tests.support.engine_processes import ENGINE_KWARGS, child_pids, process_gone, wait_until
from tests.support.faulty_executors import trigger_file
from tests.support.faulty_workers import FailOnRank1WhenTriggered, worker

import vx

SPLIT = dict(ENGINE_KWARGS, tensor_parallel_size=2)
PARAMS = vx.SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
NUM_STREAMS = 4


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _workers(engine_pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(engine_pid).children()]


async def _streams_until_failure(llm: vx.AsyncLLM, fault) -> tuple[list[float], float, list[int]]:  # noqa: ANN001
    """NUM_STREAMS streams; once each has tokens, `fault()` runs. Returns when each stream failed, when the fault
    came, and the tokens each got."""
    received = [0] * NUM_STREAMS
    failed_at: list[float] = []
    fault_at = 0.0

    async def stream(i: int) -> None:
        try:
            async for out in llm.generate([5 + i, 9, 13 + i, 2], PARAMS):
                received[i] += len(out.outputs[0].token_ids)
        except vx.EngineDeadError:
            failed_at.append(time.monotonic())

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for i in range(NUM_STREAMS):
                tg.start_soon(stream, i)
            while min(received) < 3:
                await anyio.sleep(0.01)
            fault()
            fault_at = time.monotonic()
    return failed_at, fault_at, received


@pytest.mark.slow
@pytest.mark.anyio
async def test_sigkill_of_a_worker_mid_stream_fails_every_stream_and_leaves_no_process(tiny_model_dirs):
    before = child_pids()
    async with vx.AsyncLLM(tiny_model_dirs["llama"], **SPLIT) as llm:
        engine_pid = llm._client.engine.proc.pid
        workers = _workers(engine_pid)
        assert len(workers) == 2
        failed_at, killed_at, received = await _streams_until_failure(
            llm, lambda: os.kill(workers[1], signal.SIGKILL))
        assert len(failed_at) == NUM_STREAMS and max(failed_at) - killed_at < 2.0
        assert all(n < PARAMS.max_tokens for n in received)
        with pytest.raises(vx.EngineDeadError, match="SIGKILL"):
            await llm.complete("after", PARAMS)
    assert wait_until(lambda: all(process_gone(pid) for pid in [engine_pid, *workers]), timeout=2.0)
    assert child_pids() <= before


@pytest.mark.slow
@pytest.mark.anyio
async def test_an_exception_in_a_workers_forward_fails_every_stream(tiny_model_dirs):
    before = child_pids()
    async with vx.AsyncLLM(tiny_model_dirs["llama"], **SPLIT, worker_cls=worker(FailOnRank1WhenTriggered)) as llm:
        engine_pid = llm._client.engine.proc.pid
        workers = _workers(engine_pid)
        failed_at, raised_at, _ = await _streams_until_failure(
            llm, lambda: open(trigger_file(engine_pid), "w").close())
        assert len(failed_at) == NUM_STREAMS and max(failed_at) - raised_at < 2.0
        with pytest.raises(vx.EngineDeadError, match="injected failure in rank 1's forward"):
            await llm.complete("after", PARAMS)
    os.remove(trigger_file(engine_pid))
    assert wait_until(lambda: all(process_gone(pid) for pid in [engine_pid, *workers]), timeout=2.0)
    assert child_pids() <= before


@pytest.mark.slow
def test_workers_exit_when_their_engine_is_killed(tiny_model_dirs):
    before = {p.pid for p in psutil.Process().children()}
    llm = vx.LLM(tiny_model_dirs["llama"], multiprocess=True, **SPLIT)
    try:
        [engine_pid] = {p.pid for p in psutil.Process().children()} - before
        workers = _workers(engine_pid)
        assert len(workers) == 2
        os.kill(engine_pid, signal.SIGKILL)
        assert wait_until(lambda: all(process_gone(pid) for pid in workers), timeout=3.0), "a worker outlived its engine"
    finally:
        llm.shutdown()


def test_a_worker_that_fails_to_start_fails_the_engine_start_and_leaves_no_process(tiny_model_dirs):
    before = child_pids()
    with pytest.raises(Exception, match=r"worker rank \d failed.*names no vx.gpu.worker.Worker subclass"):
        vx.LLM(tiny_model_dirs["llama"], **SPLIT, worker_cls="tests.support.faulty_workers:worker")
    assert wait_until(lambda: child_pids() <= before, timeout=2.0)
