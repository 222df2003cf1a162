"""The request guard and the header timeout against hostile clients, over real sockets on loopback: bodies over
the size limit (announced or chunked), the API key checked before the body, half-sent requests and bodies,
and the concurrency limit.

The session server runs with the default limits; `limited` is a second server with small ones (short timeouts,
two concurrent requests), so that the tests take seconds.
"""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import psutil
import pytest
from tests.support.server import (API_KEY, MODEL, connect, metric, read_response, request_head, start_server,
                                  stop_server)

from vx.serve.options import ServerOptions

MiB = 1024 * 1024
DEFAULT_LIMIT = ServerOptions().max_body_bytes
AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def limited(tiny_model_dir, tmp_path_factory):
    srv = start_server(tiny_model_dir, str(tmp_path_factory.mktemp("limited") / "server.log"),
                       "--served-model-name", MODEL, "--max-model-len", "1024", "--header-timeout", "1",
                       "--body-timeout", "1", "--max-concurrent-requests", "2")
    yield srv
    stop_server(srv)


def _rss(server) -> int:
    return psutil.Process(server.proc.pid).memory_info().rss


def test_an_announced_body_over_the_limit_is_refused_unread(server):
    with connect(server) as sock:
        sock.sendall(request_head("POST", "/v1/completions", {**AUTH, "Content-Length": str(50 * MiB)}))
        r = read_response(sock)  # at once: not a byte of the 50 MB was sent
    assert r.status == 413 and r.headers["connection"] == "close"
    assert r.json()["error"]["code"] == "request_too_large" and str(DEFAULT_LIMIT) in r.json()["error"]["message"]


def test_a_chunked_body_is_cut_at_the_limit_and_memory_stays_flat(server, http):
    before = _rss(server)
    rejected = metric(http, "vx_rejected_requests_total", 'reason="too_large"')
    sent = 0
    chunk = b"a" * (64 * 1024)
    frame = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
    with connect(server) as sock:
        sock.sendall(request_head("POST", "/v1/completions", {**AUTH, "Transfer-Encoding": "chunked"}))
        deadline = time.monotonic() + 30
        while sent < 50 * MiB and time.monotonic() < deadline:
            if select.select([sock], [], [], 0)[0]:
                break  # the server answered: it reads no more
            try:
                sock.sendall(frame)
            except (BrokenPipeError, ConnectionResetError, socket.timeout):
                break
            sent += len(chunk)
        r = read_response(sock)
    assert r.status == 413 and r.json()["error"]["code"] == "request_too_large"
    assert sent < DEFAULT_LIMIT + 8 * MiB, f"the server read {sent} bytes of a body over its limit"
    assert _rss(server) - before < 48 * MiB
    assert metric(http, "vx_rejected_requests_total", 'reason="too_large"') == rejected + 1


def test_the_api_key_is_checked_before_the_body_is_read(server):
    with connect(server, timeout=5) as sock:
        sock.sendall(request_head("POST", "/v1/chat/completions", {"Authorization": "Bearer wrong",
                                                                   "Content-Length": "1000"}))
        r = read_response(sock)  # the body never comes: only a check on the headers can answer
    assert r.status == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["connection"] == "close"  # the unread body cannot be mistaken for the next request


def test_half_sent_requests_are_closed_after_the_header_timeout(limited):
    # 200 clients: half send part of a request line and stop, half connect and send nothing.
    socks = []
    try:
        for i in range(200):
            sock = connect(limited)
            if i % 2:
                sock.sendall(b"POST /v1/completions HTT")
            socks.append(sock)
        start = time.monotonic()
        assert httpx.get(limited.url + "/health", timeout=5).status_code == 200  # others still get in
        open_ = list(socks)
        while open_ and time.monotonic() - start < 10:
            ready, _, _ = select.select(open_, [], [], 0.5)
            for sock in ready:
                assert sock.recv(1024) == b""  # closed, with no response: no request line came
                open_.remove(sock)
        closed_after = time.monotonic() - start
    finally:
        for sock in socks:
            sock.close()
    assert not open_, f"{len(open_)} of 200 half-open connections still open after 10 s"
    assert closed_after < 6  # the timeout is 1 s


def test_a_body_that_stops_arriving_is_408(limited):
    with connect(limited) as sock:
        sock.sendall(request_head("POST", "/v1/completions", {"Content-Type": "application/json",
                                                              "Content-Length": "100"}) + b'{"prompt": ')
        start = time.monotonic()
        r = read_response(sock)
    assert r.status == 408 and r.json()["error"]["code"] == "request_timeout"
    assert 0.9 < time.monotonic() - start < 5


def test_requests_beyond_the_concurrency_limit_get_429(limited):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=limited.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as one, c.stream("POST", "/v1/completions",
                                                                            json=body) as two:
            lines = [one.iter_lines(), two.iter_lines()]  # kept: a dropped iterator closes its stream
            assert all(next(it).startswith("data: ") for it in lines)  # both are running
            r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "too_many_requests"
            assert c.get("/health").status_code == 200  # probes are not generation requests
            assert metric(c, "vx_requests_in_flight") == 2
        deadline = time.monotonic() + 10  # the two were dropped: their slots free as their aborts land
        while metric(c, "vx_requests_in_flight") > 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        ok = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("body, fragment", [
    ('{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}', "lone UTF-16 surrogate"),
    ('{"model": "tiny", "prompt": "x", "max_tokens": 2, "user": ' + "[" * 5000 + "]" * 5000 + "}", "5001 deep"),
    (b'{"model": "tiny", "prompt": "\xff"}', "not valid UTF-8"),
])
def test_bodies_no_parser_should_see_are_400(http, body, fragment):
    r = http.post("/v1/completions", content=body.encode() if isinstance(body, str) else body,
                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and fragment in r.json()["error"]["message"]


def test_emoji_escapes_are_not_lone_surrogates(http):
    body = json.dumps({"model": MODEL, "prompt": "smile \U0001F600", "max_tokens": 2})  # "\ud83d\ude00"
    assert "\\ud83d\\ude00" in body
    assert http.post("/v1/completions", content=body, headers={"content-type": "application/json"}).status_code == 200
