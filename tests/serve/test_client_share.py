"""One client cannot hold every request slot (vx/serve/guard.py): its generation requests in flight are capped per
peer address, and so are its bodies that are slow to arrive. 520 connections that send their bodies slowly from one
address (127.0.0.2) hold only its share while a request from another address (127.0.0.1) is served; in-process
requests are held to no share. The guard's counting is also checked on its own, with a stand-in app and small
limits."""

from __future__ import annotations

import select
import socket
import time

import anyio
import httpx
import pytest
from tests.support.server import API_KEY, MODEL, metric, read_response, request_head

from vx.serve.asgi_transport import IN_PROCESS
from vx.serve.guard import RequestGuard, client_key
from vx.serve.inflight import SLOW_BODY_S, InFlight
from vx.serve.options import ServerOptions
from vx.serve.state import ServerState

SLOW_CLIENTS = 520  # more than the default max_concurrent_requests (512)
SLOW_ADDRESS = "127.0.0.2"  # loopback: all of 127.0.0.0/8 reaches the server on 127.0.0.1


def _slow_body(server) -> socket.socket:
    """A connection from SLOW_ADDRESS that sends a completions request's headers and the start of its body."""
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10, source_address=(SLOW_ADDRESS, 0))
    head = request_head("POST", "/v1/completions", {"Authorization": f"Bearer {API_KEY}",
                                                     "Content-Type": "application/json", "Content-Length": "1000"})
    sock.sendall(head + b'{"model": "tiny", "prompt": "')
    return sock


def _answers(socks: list[socket.socket], at_least: int, timeout: float = 20) -> list:
    """The responses that come on `socks` (answered sockets are removed): at least `at_least` of them, then until
    none comes for half a second, or `timeout` s."""
    answers = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = select.select(socks, [], [], 0.5)[0]
        if not ready and len(answers) >= at_least:
            break
        for sock in ready:
            answers.append(read_response(sock))
            socks.remove(sock)
    return answers


def test_slow_bodies_from_one_address_hold_only_its_share(server):
    options = ServerOptions()
    share, slow_share = options.max_requests_per_client, options.max_slow_bodies_per_client
    assert slow_share < share < options.max_concurrent_requests < SLOW_CLIENTS
    socks: list[socket.socket] = []
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as http:
        refused_before = metric(http, "vx_rejected_requests_total", 'reason="too_many_from_client"')
        try:
            socks = [_slow_body(server) for _ in range(SLOW_CLIENTS)]
            held = list(socks)
            answers = _answers(held, SLOW_CLIENTS - share)
            # All of the share, unless connecting took over a second: then the slow-body share stopped them sooner.
            assert slow_share <= len(held) <= share, f"{len(held)} slow bodies are being read; the share is {share}"
            assert all(a.status == 429 and a.headers["retry-after"] == "1" for a in answers)
            assert {a.json()["error"]["code"] for a in answers} == {"too_many_requests"}
            named = {m.split("(--")[1].split(")")[0] for m in (a.json()["error"]["message"] for a in answers)}
            assert named == {"max-requests-per-client"} if len(held) == share else \
                named <= {"max-requests-per-client", "max-slow-bodies-per-client"}
            assert metric(http, "vx_requests_in_flight") == len(held)  # the slots the slow bodies hold
            start = time.monotonic()
            ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            assert ok.status_code == 200, ok.text  # 127.0.0.1 is another client: served at once
            assert time.monotonic() - start < 10

            # Most of them leave; the client keeps as many slow bodies as it may: a new one is refused for that,
            # though it is far below its share of requests.
            for sock in held[slow_share:]:
                sock.close()
            deadline = time.monotonic() + 10
            while metric(http, "vx_requests_in_flight") > slow_share:
                assert time.monotonic() < deadline, "the closed connections' slots were not freed"
                time.sleep(0.05)
            time.sleep(SLOW_BODY_S)  # those kept are slow now, whenever they came
            socks.append(_slow_body(server))
            (refused,) = _answers([socks[-1]], 1, timeout=10)
            assert refused.status == 429 and "--max-slow-bodies-per-client" in refused.json()["error"]["message"]
            assert metric(http, "vx_rejected_requests_total", 'reason="too_many_from_client"') == \
                refused_before + len(answers) + 1
        finally:
            for sock in socks:
                sock.close()
        deadline = time.monotonic() + 10  # the closed connections free their slots
        while metric(http, "vx_requests_in_flight") > 0:
            assert time.monotonic() < deadline, "the slow bodies' slots were not freed"
            time.sleep(0.05)


# ------------------------------------------------------------------------------- the guard alone, with a stand-in app
BOTH_BACKENDS = pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])


class HeldApp:
    """Answers 200 once `release` is set, counting the requests that reached it."""

    def __init__(self) -> None:
        self.release = anyio.Event()
        self.reached = 0

    async def __call__(self, scope, receive, send) -> None:
        self.reached += 1
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}"})


async def _request(guard: RequestGuard, host: str | None, statuses: list[int], *,
                   body_arrives: anyio.Event | None = None, in_process: bool = False) -> None:
    """POST /v1/completions from `host` through `guard`, its body held back until `body_arrives` is set; appends the
    response status to `statuses`."""
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"content-length", b"2")],
             "client": (host, 40000) if host is not None else None}
    if in_process:
        scope["extensions"] = {IN_PROCESS: {}}

    async def receive():
        if body_arrives is not None:
            await body_arrives.wait()
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    await guard(scope, receive, send)


def _guard(slow_body_s: float = SLOW_BODY_S, **options) -> tuple[RequestGuard, HeldApp]:
    app = HeldApp()
    state = ServerState(llm=None, served_model_names=[MODEL], options=ServerOptions(**options),
                        inflight=InFlight(slow_body_s))
    return RequestGuard(app, state), app


@pytest.mark.anyio
@BOTH_BACKENDS
async def test_generation_requests_are_capped_per_client_but_not_in_process(anyio_backend):
    guard, app = _guard(max_requests_per_client=2, max_concurrent_requests=10)
    statuses: list[int] = []
    async with anyio.create_task_group() as tg:
        for host in ["10.0.0.1", "10.0.0.1", "10.0.0.1", "10.0.0.2"]:
            tg.start_soon(_request, guard, host, statuses)
            await anyio.wait_all_tasks_blocked()
        assert statuses == [429] and app.reached == 3  # the third from 10.0.0.1 was refused; 10.0.0.2 got in
        for _ in range(3):  # the embedding app's own requests (all "127.0.0.1") count against no share
            tg.start_soon(lambda: _request(guard, "127.0.0.1", statuses, in_process=True))
        await anyio.wait_all_tasks_blocked()
        assert app.reached == 6
        app.release.set()
    assert sorted(statuses) == [200] * 6 + [429]
    assert guard.state.inflight.generating == 0 and guard.state.inflight.generating_for("10.0.0.1") == 0


@pytest.mark.anyio
@BOTH_BACKENDS
async def test_bodies_slow_to_arrive_are_capped_per_client(anyio_backend):
    # slow_body_s=0: every body still arriving is a slow one
    guard, app = _guard(slow_body_s=0.0, max_slow_bodies_per_client=1, max_requests_per_client=10)
    statuses: list[int] = []
    body = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: _request(guard, "2001:db8::1", statuses, body_arrives=body))
        await anyio.wait_all_tasks_blocked()
        # Another address in the same /64 is the same client: refused while the first body is still arriving.
        await _request(guard, "2001:db8::2", statuses, body_arrives=body)
        assert statuses == [429] and guard.state.inflight.slow_bodies_for("2001:db8::/64") == 1
        tg.start_soon(lambda: _request(guard, "2001:db9::1", statuses, body_arrives=body))  # another /64
        await anyio.wait_all_tasks_blocked()
        assert statuses == [429]
        body.set()
        await anyio.wait_all_tasks_blocked()
        assert app.reached == 2 and guard.state.inflight.slow_bodies_for("2001:db8::/64") == 0  # body in
        app.release.set()
    assert sorted(statuses) == [200, 200, 429]


@pytest.mark.anyio
@BOTH_BACKENDS
async def test_a_burst_of_bodies_arriving_at_once_is_not_slow(anyio_backend):
    guard, app = _guard(max_slow_bodies_per_client=1, max_requests_per_client=10)
    statuses: list[int] = []
    body = anyio.Event()
    async with anyio.create_task_group() as tg:
        for _ in range(5):  # every body still on its way, none for long
            tg.start_soon(lambda: _request(guard, "10.0.0.1", statuses, body_arrives=body))
        await anyio.wait_all_tasks_blocked()
        body.set()
        await anyio.wait_all_tasks_blocked()
        assert app.reached == 5
        app.release.set()
    assert statuses == [200] * 5



@pytest.mark.anyio
@BOTH_BACKENDS
async def test_a_late_event_loop_does_not_make_bodies_slow(anyio_backend):
    # A busy server reads a body late: that time is the server's, not the client's.
    inflight = InFlight(slow_body_s=0.3)
    async with anyio.create_task_group() as tg:
        tg.start_soon(inflight.watch_loop)
        await anyio.sleep(0.15)
        began = time.monotonic()
        with inflight.receiving_body("10.0.0.1"):
            time.sleep(0.5)  # the loop is held: every body waits for it
            await anyio.sleep(0.05)
            assert inflight.lateness_since(began) > 0.3
            assert inflight.slow_bodies_for("10.0.0.1") == 0
            await anyio.sleep(0.8)  # still arriving long after the loop caught up: a slow sender
            assert inflight.slow_bodies_for("10.0.0.1") == 1
        tg.cancel_scope.cancel()

def test_a_client_is_its_address_or_its_ipv6_64():
    def key(client, **scope):
        return client_key({"client": client, **scope})

    assert key(("203.0.113.7", 5000)) == "203.0.113.7"
    assert key(("2001:db8:1:2:aaaa::1", 5000)) == key(("2001:db8:1:2:bbbb::9", 1)) == "2001:db8:1:2::/64"
    assert key(("::ffff:203.0.113.7", 5000)) == "203.0.113.7"  # an IPv4 peer on a dual-stack socket
    assert key(None) == ""  # a Unix socket: one peer for all
    assert key(("127.0.0.1", 0), extensions={IN_PROCESS: {}}) is None
