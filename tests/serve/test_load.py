"""Load on the session server, bounded in count and time: a storm of 300 streams of which a third disconnect,
and slow readers beside normal streams. What must hold: every stream that stays is complete, everything is
released at once (the /metrics gauges and the engine's KV blocks back to 0), and a client that does not read
slows no one else."""

from __future__ import annotations

import functools
import json
import socket
import time

import anyio
import httpx
import pytest
from tests.support.server import API_KEY, MODEL, metric, request_head

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
GAUGES = ("vx_num_requests_running", "vx_num_requests_waiting", "vx_kv_blocks_in_use", "vx_requests_in_flight")


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _wait_for_idle(http: httpx.Client, timeout: float = 5.0) -> float:
    """Seconds until every gauge of GAUGES reads 0 (fails after `timeout`)."""
    start = time.monotonic()
    while any(metric(http, g) != 0 for g in GAUGES):
        assert time.monotonic() - start < timeout, {g: metric(http, g) for g in GAUGES}
        time.sleep(0.05)
    return time.monotonic() - start


async def _stream(client: httpx.AsyncClient, max_tokens: int, leave_early: bool = False, **extra) -> list[str]:
    body = {"model": MODEL, "prompt": "Tell me", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            **extra}
    lines = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line:
                lines.append(line)
                if leave_early:
                    break  # leaving the block closes the connection: the server sees a disconnect
    return lines


@pytest.mark.slow
@pytest.mark.anyio
async def test_storm_of_300_streams_with_a_third_leaving_releases_everything(server, http):
    results: dict[int, list[str]] = {}
    limits = httpx.Limits(max_connections=320, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.url, headers=HEADERS, limits=limits, timeout=120) as client:
        async def one(i: int) -> None:
            results[i] = await _stream(client, 24, leave_early=i % 3 == 0)

        with anyio.fail_after(240):
            async with anyio.create_task_group() as tg:
                for i in range(300):
                    tg.start_soon(one, i)
    assert len(results) == 300
    for i, lines in results.items():
        if i % 3:  # stayed: complete, in order, and closed by [DONE]
            assert lines[-1] == "data: [DONE]"
            chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert _wait_for_idle(http) < 5.0


# A stream of ~6 MB (the tiny model writes a few bytes per token): more than the kernel's socket buffers take (tcp_wmem's 4 MiB), so that the server's writes
# to a client that reads nothing really block.
HEAVY = dict(max_tokens=900, n=8, logprobs=20)


def _slow_reader(server) -> socket.socket:
    """A client that asks for a heavy stream and then reads nothing (a tiny receive window)."""
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect((host, int(port)))
    body = json.dumps({"model": MODEL, "prompt": "Tell me", "stream": True, "ignore_eos": True, **HEAVY}).encode()
    sock.sendall(request_head("POST", "/v1/completions", {**HEADERS, "Content-Type": "application/json",
                                                          "Content-Length": str(len(body))}) + body)
    return sock


async def _timed_normal_streams(client: httpx.AsyncClient, n: int, max_tokens: int) -> float:
    start = time.monotonic()
    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(_stream, client, max_tokens)
    return time.monotonic() - start


@pytest.mark.slow
@pytest.mark.anyio
async def test_slow_readers_do_not_slow_normal_streams(server, http):
    async with httpx.AsyncClient(base_url=server.url, headers=HEADERS, timeout=120) as client:
        with anyio.fail_after(180):
            await _timed_normal_streams(client, 2, 8)  # warm up
            # The baseline: the same heavy requests beside, read at full speed (the same work for the engine).
            async with anyio.create_task_group() as tg:
                for _ in range(4):
                    tg.start_soon(functools.partial(_stream, client, **HEAVY))
                await anyio.sleep(0.5)
                fast_beside = await _timed_normal_streams(client, 4, 200)
            slow = [_slow_reader(server) for _ in range(4)]
            try:
                await anyio.sleep(0.5)
                slow_beside = await _timed_normal_streams(client, 4, 200)
                while metric(http, "vx_num_requests_running") > 0:  # the slow readers' generation ends...
                    await anyio.sleep(0.1)
                # ... but not their responses: each is stuck in a write the client does not read.
                assert metric(http, "vx_requests_in_flight") == 4
            finally:
                for sock in slow:
                    sock.close()
    assert slow_beside < 2 * fast_beside + 1.0, \
        f"normal streams took {slow_beside:.2f} s beside slow readers, {fast_beside:.2f} s beside fast ones"
    _wait_for_idle(http)  # a closed slow reader frees its request at once
