"""Whole-system: 64 concurrent AsyncLLM streams (asyncio and trio) and `LLM(multiprocess=True)` give exactly
what the in-process `vx.LLM` gives for the same greedy requests; then each engine dies (a fault inside
execute_model under AsyncLLM, SIGKILL under `LLM(multiprocess=True)`) and every caller hears of it."""

from __future__ import annotations

import os
import signal
import time

import anyio
import pytest
from tests.support.engine_processes import ENGINE_KWARGS, child_pids, process_gone
from tests.support.faulty_executors import FailOnceTriggered, backend, trigger_file

import vx
from vx.sampling_params import RequestOutputKind as Kind

PROMPTS = [f"Request number {i}: {'abcdefghij'[i % 10] * (1 + i % 7)}" for i in range(64)]
PARAMS = vx.SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[tuple[str, list[int]]]:
    """The in-process engine's greedy outputs for PROMPTS."""
    llm = vx.LLM(tiny_model_dir, **ENGINE_KWARGS)
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    return [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.anyio
async def test_64_concurrent_streams_match_in_process_llm_then_engine_fault(anyio_backend, tiny_model_dir,
                                                                          reference):
    before = child_pids()
    texts: dict[int, str] = {}
    token_ids: dict[int, list[int]] = {}

    async def by_stream(i: int) -> None:
        texts[i] = "".join([t async for t in llm.stream(PROMPTS[i], PARAMS)])

    async def by_generate(i: int) -> None:
        outs = [o async for o in llm.generate(PROMPTS[i], PARAMS.clone(output_kind=Kind.DELTA))]
        texts[i] = "".join(o.outputs[0].text for o in outs)
        token_ids[i] = [t for o in outs for t in o.outputs[0].token_ids]

    # Armed: the engine's executor raises inside execute_model once the trigger file exists.
    async with vx.AsyncLLM(tiny_model_dir, **ENGINE_KWARGS,
                           distributed_executor_backend=backend(FailOnceTriggered)) as llm:
        crash_file = trigger_file(llm._client.engine.proc.pid)
        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(by_stream if i % 2 == 0 else by_generate, i)
        for i, (text, ids) in enumerate(reference):
            assert texts[i] == text, i
            if i in token_ids:
                assert token_ids[i] == ids, i
        stats = await llm.stats()
        assert (stats.num_running, stats.num_waiting, stats.kv_blocks_in_use) == (0, 0, 0)
        assert llm.output_processor.request_states == {} and llm.output_processor.queues() == []

        # The engine raises inside execute_model: every stream gets EngineDeadError carrying the message.
        started, failed = [], []

        async def victim(i: int) -> None:
            with pytest.raises(vx.EngineDeadError, match="injected failure") as info:
                async for _ in llm.stream(f"victim {i}", PARAMS.clone(max_tokens=5000, ignore_eos=True)):
                    started.append(i)
            assert "Traceback" in str(info.value.__cause__)
            failed.append(time.monotonic())

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(victim, i)
                while len(set(started)) < 4:
                    await anyio.sleep(0.01)
                open(crash_file, "w").close()
                crashed_at = time.monotonic()
        assert len(failed) == 4 and max(failed) - crashed_at < 2.0
        with pytest.raises(vx.EngineDeadError, match="injected failure"):
            await llm.complete("after", PARAMS)
        os.remove(crash_file)
        ipc_dir = llm._client.engine.ipc_dir
        exit_started = time.monotonic()
    assert time.monotonic() - exit_started < 2.0, "leaving `async with` took too long"
    assert child_pids() <= before
    assert not os.path.exists(ipc_dir)


def test_llm_multiprocess_matches_in_process(tiny_model_dir, reference):
    before = child_pids()
    llm = vx.LLM(tiny_model_dir, multiprocess=True, **ENGINE_KWARGS)
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs] == reference
        stats = llm.stats()
        assert (stats.num_running, stats.num_waiting, stats.kv_blocks_in_use) == (0, 0, 0)
        assert stats.num_steps > 0
        assert not llm.llm_engine.output_processor.request_states

        # SIGKILL under the synchronous client: the blocked generate() raises within 2 s.
        pid = llm.llm_engine.engine_core.engine.proc.pid
        llm.llm_engine.add_request("victim", "long one", vx.SamplingParams(max_tokens=200, ignore_eos=True))
        assert llm.llm_engine.step() is not None
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(vx.EngineDeadError, match="SIGKILL"):
            while llm.llm_engine.has_unfinished_requests():
                llm.llm_engine.step()
        assert time.monotonic() - t0 < 2.0
        with pytest.raises(vx.EngineDeadError):
            llm.generate("new", PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    assert process_gone(pid) and child_pids() <= before
