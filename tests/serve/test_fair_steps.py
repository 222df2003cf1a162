"""A heavy request beside a normal stream, against `vx serve`: the stream's first token and its largest gap stay
bounded (fair steps in the scheduler), and `/health` answers 200 throughout (a busy engine is not a dead one)."""

from __future__ import annotations

import gc
import json
import threading
import time

import anyio
import httpx
import pytest

from tests.support.server import API_KEY, MODEL
from vx.errors import EngineDeadError
from vx.outputs import EngineStats
from vx.serve.app import build_app

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
FIRST_TOKEN_BOUND_S = 2.0
GAP_BOUND_S = 1.0


class Beside:
    """Streams `body` (a completions request) in a thread until the block ends, then leaves (the server aborts it),
    and polls /health meanwhile."""

    def __init__(self, url: str, body: dict) -> None:
        self.url, self.body = url, {**body, "stream": True}
        self.status: int | None = None
        self.chunks = 0
        self.health: list[int] = []
        self._done = threading.Event()
        self._threads = [threading.Thread(target=self._heavy), threading.Thread(target=self._probe)]

    def _heavy(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, headers=HEADERS,
                              timeout=120) as r:
                self.status = r.status_code
                for _ in r.iter_lines():
                    self.chunks += 1
                    if self._done.is_set():
                        break
        finally:
            self._done.set()

    def _probe(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as c:
            while not self._done.wait(0.25):
                self.health.append(c.get("/health").status_code)

    def __enter__(self) -> "Beside":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        for t in self._threads:
            t.join(timeout=120)


def stream_timings(url: str, max_tokens: int = 24) -> tuple[float, float, int]:
    """(time to first token, largest gap between tokens, tokens) of a normal streamed completion."""
    # logprobs=0: every token sends a chunk, including those whose bytes end no character yet.
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "temperature": 0, "logprobs": 0}
    stamps = []
    # The measuring process's own full collections (a whole test session's heap) must not count as the server's gaps.
    gc.disable()
    try:
        start = time.monotonic()
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=HEADERS, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[6:])["choices"]
                    stamps += [time.monotonic()] * len(choices[0]["logprobs"]["tokens"]) if choices else []
    finally:
        gc.enable()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - start, max(gaps, default=0.0), len(stamps)


def test_a_stream_beside_a_128_way_fan_out_with_logprobs_keeps_its_pace(server):
    # Long enough that, first come first served, the stream would wait for a whole batch of children to finish.
    # (Within the server's limit on logprob entries: 128 x 300 x 21.)
    heavy = {"model": MODEL, "prompt": "The capital of France is", "n": 128, "logprobs": 20, "max_tokens": 300,
             "ignore_eos": True}
    with Beside(server.url, heavy) as beside:
        deadline = time.monotonic() + 60
        while beside.chunks < 200:  # the fan-out has filled the batch
            assert beside.status in (None, 200) and time.monotonic() < deadline, beside.status
            time.sleep(0.05)
        first, gap, tokens = stream_timings(server.url)
    assert beside.status == 200
    assert tokens == 24
    print(f"beside a 128-way fan-out: first token {first:.2f} s, largest gap {gap:.2f} s")
    assert first < FIRST_TOKEN_BOUND_S, first
    assert gap < GAP_BOUND_S, gap
    assert beside.health and set(beside.health) == {200}


class EngineDouble:
    """Enough of a `vx.AsyncLLM` for /health: its stats answer after `delay` seconds, or raise `error`."""

    config = None
    tokenizer = None
    errored = False

    def __init__(self, delay: float = 0.0, error: BaseException | None = None) -> None:
        self.delay, self.error = delay, error

    async def stats(self):
        if self.error is not None:
            raise self.error
        await anyio.sleep(self.delay)
        return EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("engine, status, body", [
    (EngineDouble(), 200, "ok"),
    (EngineDouble(delay=60), 200, "busy"),  # a long step: alive, answering between steps
    (EngineDouble(error=EngineDeadError("The vx engine died: test.")), 503, "engine_dead"),
    (EngineDouble(error=RuntimeError("Start the engine first")), 503, "engine_dead"),
])
async def test_health_tells_busy_from_dead(anyio_backend, engine, status, body):
    app = build_app(engine, served_model_names=["m"], start_engine=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        start = time.monotonic()
        r = await c.get("/health")
    assert r.status_code == status and body in r.text
    assert time.monotonic() - start < 5  # never waits for a busy engine's answer
