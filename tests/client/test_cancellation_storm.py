"""Cancellation storm: 1,000 concurrent AsyncLLM streams on a KV cache too small for them (so requests are
preempted and resumed), half of them cancelled at random moments (waiting, prefilling, decoding, preempted)
by the three ways an application leaves a stream: `break`, cancelling a task's cancel scope, and
`anyio.fail_after`. Every stream that runs to its end must give exactly the in-process `vx.LLM`'s greedy text,
and afterwards nothing may be left: no KV block in use, no queued request, no per-request state in the front end.
"""

from __future__ import annotations

import gc
import random
import weakref

import anyio
import pytest
from tests.support.engine_processes import child_pids

import vx
from vx.client.async_llm import AsyncLLM, _abort_lost_stream

pytestmark = pytest.mark.slow

NUM_STREAMS = 1000
PROMPTS = [f"storm {i} {'xyz'[i % 3] * (i % 5)}" for i in range(NUM_STREAMS)]
PARAMS = vx.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# 39 usable blocks of 16 tokens for up to 64 running requests of 2 blocks each: decode steps run out of blocks
# and preempt, and preempted requests are resumed (recomputed) later.
STORM_ENGINE = dict(dtype="float32", device="cpu", max_model_len=64, block_size=16, num_kv_blocks=40,
                    max_num_seqs=64)
# The reference engine has room for everything: no preemption there.
REFERENCE_ENGINE = dict(STORM_ENGINE, num_kv_blocks=2100, max_num_seqs=1024)
CANCEL_KINDS = ("break", "scope", "fail_after")


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[str]:
    """The in-process `vx.LLM`'s greedy text for each prompt."""
    llm = vx.LLM(tiny_model_dir, **REFERENCE_ENGINE)
    try:
        return [o.outputs[0].text for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.shutdown()


def front_end_state(llm: AsyncLLM) -> dict[str, int]:
    """Sizes of every per-request structure the front end keeps (all must be 0 once nothing runs)."""
    return {
        "streams": len(llm.output_processor.queues()),
        "deferred_drops": len(llm.output_processor.deferred_drops),
        "request_states": len(llm.output_processor.request_states),
        "parent_requests": len(llm.output_processor.parent_requests),
        "utility_waiters": len(llm._client._utility_waiters),
        "pending_sends": len(llm._client.engine._pending_sends),
        "unfinished": llm.num_unfinished_requests,
        # GC safety nets of streams that are still alive and were never detached
        "stream_finalizers": sum(1 for info in weakref.finalize._registry.values()  # type: ignore[attr-defined]
                                 if info.func is _abort_lost_stream),
    }


async def wait_idle(llm: AsyncLLM, timeout: float = 10.0) -> vx.EngineStats:
    """Stats once the engine and the front end hold no request (generators dropped by `break` are finalized
    by the event loop's async-generator hooks, a moment after the loop left them)."""
    with anyio.move_on_after(timeout):
        while True:
            gc.collect()
            stats = await llm.stats()
            if (stats.num_running, stats.num_waiting, stats.kv_blocks_in_use) == (0, 0, 0) \
                    and not any(front_end_state(llm).values()):
                return stats
            await anyio.sleep(0.05)
    return await llm.stats()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.anyio
async def test_cancellation_storm(anyio_backend, tiny_model_dir, reference):
    rng = random.Random(2024 if anyio_backend == "asyncio" else 4202)
    plan = ["run"] * (NUM_STREAMS // 2) + [CANCEL_KINDS[i % 3] for i in range(NUM_STREAMS // 2)]
    rng.shuffle(plan)
    texts: dict[int, str] = {}  # text received, for every stream
    completed: set[int] = set()  # streams that reached their end

    async def consume(i: int, break_after: int | None = None) -> None:
        text = ""
        n = 0
        async for delta in llm.stream(PROMPTS[i], PARAMS):
            text += delta
            texts[i] = text
            n += 1
            if n == break_after:
                break
        else:
            completed.add(i)
        texts[i] = text

    async def cancelled_by_scope(i: int, delay: float) -> None:
        async with anyio.create_task_group() as tg:  # cancels the consuming task from outside
            tg.start_soon(consume, i)
            await anyio.sleep(delay)
            tg.cancel_scope.cancel()

    async def cancelled_by_timeout(i: int, delay: float) -> None:
        try:
            with anyio.fail_after(delay):
                await consume(i)
        except TimeoutError:
            pass

    before = child_pids()
    async with vx.AsyncLLM(tiny_model_dir, **STORM_ENGINE) as llm:
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i, kind in enumerate(plan):
                    # Random moments: right away (still waiting), during prefill or decode, or while preempted.
                    delay = rng.choice([0.0, rng.uniform(0.0, 0.05), rng.uniform(0.0, 1.0)])
                    if kind == "run":
                        tg.start_soon(consume, i)
                    elif kind == "break":
                        tg.start_soon(consume, i, rng.randint(1, PARAMS.max_tokens - 1))
                    elif kind == "scope":
                        tg.start_soon(cancelled_by_scope, i, delay)
                    else:
                        tg.start_soon(cancelled_by_timeout, i, delay)

        survivors = [i for i, kind in enumerate(plan) if kind == "run"]
        assert set(survivors) <= completed
        for i in survivors:
            assert texts[i] == reference[i], (i, texts[i], reference[i])
        for i in completed:  # a "cancelled" stream may have ended before its moment came
            assert texts[i] == reference[i], (i, texts[i], reference[i])
        for i, text in texts.items():  # what a cancelled stream saw is the start of its text
            assert reference[i].startswith(text), (i, text, reference[i])
        num_cancelled = NUM_STREAMS - len(completed)
        assert num_cancelled >= NUM_STREAMS // 4, f"only {num_cancelled} streams were cancelled before their end"

        stats = await wait_idle(llm)
        assert stats.num_preemptions > 0, stats
        assert (stats.num_running, stats.num_waiting, stats.kv_blocks_in_use) == (0, 0, 0), stats
        assert front_end_state(llm) == dict.fromkeys(front_end_state(llm), 0)
        assert llm.output_processor.request_states == {} and llm.output_processor.queues() == []
        assert (await llm.complete(PROMPTS[0], PARAMS)).outputs[0].text == reference[0]  # still serving
    assert child_pids() <= before
