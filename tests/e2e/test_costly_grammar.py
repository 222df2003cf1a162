"""A small regex whose next-token masks are costly on a real vocabulary (the default model's 49k tokens), sent
32 ways beside a normal stream: it is refused as too costly to follow, quickly, and the stream keeps its pace."""

from __future__ import annotations

import time

import anyio
import pytest

import vx
from vx.errors import InvalidRequestError
from vx.sampling_params import RequestOutputKind

pytestmark = pytest.mark.anyio

# 47 bytes, compiles in a fraction of a second to under 2 MiB, yet each mask costs ~0.2-4 s a sequence here.
COSTLY_REGEX = "([a-z ]{0,20}[a-z ]{0,20}[a-z ]{0,20}){0,200}"


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_a_costly_regex_32_ways_is_refused_and_a_stream_beside_it_keeps_its_pace(default_model_dir):
    async with vx.AsyncLLM(None, max_model_len=512) as llm:
        # The engine's first grammar builds xgrammar's view of the 49k-token vocabulary (seconds, partly holding the
        # GIL): done first, so that what follows measures the costly regex alone.
        await llm.complete("Answer:", vx.SamplingParams(max_tokens=2, structured_outputs=vx.StructuredOutputsParams(
            choice=["yes", "no"])))
        refused: list[tuple[float, BaseException]] = []
        stamps: list[float] = []

        async def costly() -> None:
            start = time.monotonic()
            params = vx.SamplingParams(n=32, max_tokens=64,
                                       structured_outputs=vx.StructuredOutputsParams(regex=COSTLY_REGEX))
            try:
                async for _ in llm.generate("Write some words:", params):
                    pass
            except InvalidRequestError as e:
                refused.append((time.monotonic() - start, e))

        async def stream() -> float:
            start = time.monotonic()
            params = vx.SamplingParams(max_tokens=24, ignore_eos=True, temperature=0, output_kind=RequestOutputKind.DELTA)
            async for out in llm.generate("Once upon a time", params):
                stamps.extend([time.monotonic()] * len(out.outputs[0].token_ids))
            return start

        async with anyio.create_task_group() as tg:
            tg.start_soon(costly)
            await anyio.sleep(0.05)
            start = await stream()
        assert len(stamps) == 24
        first, gap = stamps[0] - start, max(b - a for a, b in zip(stamps, stamps[1:]))
        assert first < 2.0 and gap < 1.0, (first, gap)
        assert len(refused) == 1, "the costly regex was not refused"
        seconds, error = refused[0]
        assert "structured_outputs.regex is too costly to follow" in str(error)
        assert seconds < 3.0
        stats = await llm.stats()
        assert (stats.num_running, stats.num_waiting) == (0, 0)
