"""The multiprocess engine-core clients: AsyncMPClient on asyncio and trio, and the thread-safe send path. (The
config they send to the engine process is tested in tests/config/test_wire.py.)"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time
from contextlib import asynccontextmanager

import anyio
import msgspec
import pytest
import zmq
from tests.support.engine_processes import ENGINE_KWARGS, child_pids, process_gone

import vx
from vx.client.core_client import AsyncMPClient
from vx.client.engine_process import EngineProcess
from vx.config import EngineArgs
from vx.core.protocol import EngineCoreRequest
from vx.core.protocol import EngineCoreRequestType as T

GREEDY = vx.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture(scope="module")
async def client(anyio_backend, tiny_model_dir):
    config = EngineArgs(model=tiny_model_dir, **ENGINE_KWARGS).create_config(light=True)
    c = await anyio.to_thread.run_sync(AsyncMPClient, config)
    yield c
    await anyio.to_thread.run_sync(c.shutdown)


@asynccontextmanager
async def serving(client: AsyncMPClient):
    """Run the reader and the watcher, as AsyncLLM does; collect outputs per request and any death."""
    seen: dict[str, list] = collections.defaultdict(list)
    state = {"input_errors": [], "dead": None}

    async def reader() -> None:
        try:
            while True:
                outs = await client.get_output_async()
                for o in outs.outputs:
                    seen[o.request_id].append(o)
                state["input_errors"] += outs.input_errors
        except vx.EngineDeadError as e:
            state["dead"] = (time.monotonic(), e)

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        tg.start_soon(client.watch_engine)
        yield seen, state
        tg.cancel_scope.cancel()


def request(rid: str, max_tokens: int = 6) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=[3, 4, 5], sampling_params=GREEDY.clone(
        max_tokens=max_tokens))


async def wait_for(predicate, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.01)


# ------------------------------------------------------------------------------------------------ no engine
def test_send_is_thread_safe_and_survives_reentry():
    """A send while the lock is taken (another thread, or a finalizer in the holder's own thread) is queued
    and flushed by the holder, in order."""
    ctx = zmq.Context()
    ep = object.__new__(EngineProcess)
    ep.input_socket, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    pull.bind("inproc://send-test")
    ep.input_socket.connect("inproc://send-test")
    ep._send_lock, ep._pending_sends, ep._closed = threading.Lock(), collections.deque(), False
    try:
        with ep._send_lock:
            ep.send(T.ABORT, ["first"])
            assert len(ep._pending_sends) == 1 and not pull.poll(50)
        ep.send(T.ABORT, ["second"])
        assert [msgspec.msgpack.decode(pull.recv_multipart()[1]) for _ in range(2)] == [["first"], ["second"]]

        def hammer(tag: str) -> None:
            for i in range(200):
                ep.send(T.ABORT, [f"{tag}{i}"])

        threads = [threading.Thread(target=hammer, args=(t,)) for t in "abcd"]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ids = [msgspec.msgpack.decode(pull.recv_multipart()[1])[0] for _ in range(800)]
        for tag in "abcd":
            assert [i for i in ids if i[0] == tag] == [f"{tag}{i}" for i in range(200)]
    finally:
        ep.input_socket.close(0)
        pull.close(0)
        ctx.term()


# ------------------------------------------------------------------------------------------- async client
@pytest.mark.anyio
async def test_requests_utility_calls_and_abort(client):
    with pytest.raises(NotImplementedError):
        client.get_output()
    async with serving(client) as (seen, state):
        client.add_request(request("a", 5))
        client.add_request(request("b", 300))
        await wait_for(lambda: seen["a"] and seen["a"][-1].finished and len(seen["b"]) >= 3)
        assert sum(len(o.new_token_ids) for o in seen["a"]) == 5
        client.abort_requests(["b"])
        stats = await client.stats_async()
        assert (stats.num_running, stats.num_waiting, stats.kv_blocks_in_use) == (0, 0, 0)
        assert not seen["b"][-1].finished
        with pytest.raises(RuntimeError, match="unknown utility method"):
            await client.call_utility_async("no_such_method")
        assert await client.call_utility_async("has_unfinished_requests") is False

        client.add_request(request("dup", 300))
        client.add_request(request("dup", 300))
        await wait_for(lambda: state["input_errors"])
        assert state["input_errors"][0].request_id == "dup"
        client.abort_requests(["dup"])
        assert (await client.stats_async()).num_running == 0
        assert state["dead"] is None


@pytest.mark.anyio
async def test_sigkill_is_noticed_through_the_sentinel(client):
    """Keep last in the module: kills the engine."""
    before = child_pids()
    pid, ipc_dir = client.engine.proc.pid, client.engine.ipc_dir
    async with serving(client) as (seen, state):
        client.add_request(request("victim", 5000))
        await wait_for(lambda: seen["victim"])
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(vx.EngineDeadError, match="SIGKILL"):
            await client.call_utility_async("stats")  # sent into the void: must not hang
        await wait_for(lambda: state["dead"] is not None, timeout=2.0)
        assert state["dead"][0] - killed_at < 2.0
        with pytest.raises(vx.EngineDeadError):
            client.add_request(request("late"))
        client.abort_requests(["victim"])  # aborting on a dead engine is a quiet no-op
    await anyio.to_thread.run_sync(client.shutdown)
    assert process_gone(pid) and not os.path.exists(ipc_dir)
    assert child_pids() <= before - {pid}


# ------------------------------------------------------------------------------------------- sync client
def test_priority_scheduling_reaches_the_engine_process(tiny_model_dir):
    """`scheduling_policy` once got lost on the way to the engine process. One request runs at a time: "first"
    (sent first, and the most urgent, so it runs first either way), then the others by priority; first come first
    served would finish them in the order they were sent."""
    llm = vx.LLM(tiny_model_dir, multiprocess=True, scheduling_policy="priority", max_num_seqs=1, **ENGINE_KWARGS)
    try:
        engine = llm.llm_engine
        for rid, priority in [("first", 0), ("low", 3), ("mid", 2), ("high", 1)]:
            engine.add_request(rid, [3, 4, 5], GREEDY, priority=priority)
        finished = []
        while engine.has_unfinished_requests():
            finished += [o.request_id for o in engine.step() if o.finished]
        assert finished == ["first", "high", "mid", "low"]
    finally:
        llm.shutdown()
