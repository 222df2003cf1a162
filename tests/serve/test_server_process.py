"""`vx serve` as a process: loopback by default, no torch in the server, JSON mode on the default model, a clean
stop (the engine process goes with it), a drain on SIGTERM, and an exit (or, on request, 503s) when the engine
dies."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import openai
import psutil
import pytest
from tests.support.server import start_server, stop_server


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_server_process_has_no_torch_and_its_engine_does(server):
    proc = psutil.Process(server.proc.pid)
    assert not _maps_torch(proc.pid)
    engines = proc.children(recursive=True)
    assert any(_maps_torch(c.pid) for c in engines if c.is_running())  # the check can see torch


def test_binds_loopback_by_default(server):
    listening = [c for c in psutil.Process(server.proc.pid).net_connections(kind="inet") if c.status == "LISTEN"]
    assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening)


@pytest.mark.slow
def test_default_model_json_mode_then_clean_stop(default_model_dir, tmp_path):
    srv = start_server(default_model_dir, str(tmp_path / "server.log"), "--served-model-name", "smol",
                       "--max-model-len", "1024")
    children = psutil.Process(srv.proc.pid).children(recursive=True)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        out = client.chat.completions.create(
            model="smol", temperature=0, max_tokens=60, response_format={"type": "json_object"},
            messages=[{"role": "user", "content": "Give me a JSON object with the name and the capital of France."}])
        assert out.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    finally:
        code = stop_server(srv)
    assert code == 0, srv.log()
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"left behind: {alive}"


def _engine_of(server) -> psutil.Process:
    engines = [c for c in psutil.Process(server.proc.pid).children(recursive=True) if _maps_torch(c.pid)]
    assert len(engines) == 1
    return engines[0]


def _stream_lines(url: str, max_tokens: int, out: list[str]) -> None:
    """Read one completion stream into `out` (its `data:` lines, or what ended it)."""
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            out.extend(line for line in r.iter_lines() if line)
    except httpx.HTTPError as e:
        out.append(f"{type(e).__name__}: {e}")


def _error_then_done(lines: list[str]) -> dict:
    """The error of a stream that ended with `data: {"error": ...}` and `data: [DONE]`."""
    assert lines[-1] == "data: [DONE]", lines[-3:]
    return json.loads(lines[-2].removeprefix("data: "))["error"]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_engine_death_with_keep_alive_answers_503(tiny_model_dir, tmp_path):
    srv = start_server(tiny_model_dir, str(tmp_path / "server.log"), "--served-model-name", "tiny",
                       "--keep-alive-on-engine-death")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(model="tiny", prompt="Hi", max_tokens=1000, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        _engine_of(srv).kill()
        with pytest.raises(openai.APIError, match="engine"):  # the open stream ends with an error event
            for _ in stream:
                pass
        deadline = time.monotonic() + 30
        while httpx.get(srv.url + "/health").status_code != 503:
            assert time.monotonic() < deadline, "/health still 200 with the engine dead"
            time.sleep(0.1)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="tiny", prompt="Hi", max_tokens=4)
        assert e.value.status_code == 503 and e.value.body["code"] == "engine_dead"
        metrics = httpx.get(srv.url + "/metrics").text
        assert "vx_kv_blocks_in_use NaN" in metrics  # unknown, not the last value seen
        time.sleep(2)
        assert srv.proc.poll() is None, "the server exited despite --keep-alive-on-engine-death"
    finally:
        stop_server(srv)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_engine_death_drains_and_exits_nonzero(tiny_model_dir, tmp_path):
    srv = start_server(tiny_model_dir, str(tmp_path / "server.log"), "--served-model-name", "tiny")
    try:
        lines: list[str] = []
        reader = threading.Thread(target=_stream_lines, args=(srv.url, 1000, lines))
        reader.start()
        deadline = time.monotonic() + 30
        while not lines:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        _engine_of(srv).kill()
        killed = time.monotonic()
        reader.join(timeout=10)
        assert _error_then_done(lines)["code"] == "engine_dead"
        code = srv.proc.wait(timeout=10)
        exited_after = time.monotonic() - killed
    finally:
        if srv.proc.poll() is None:
            stop_server(srv)
    assert code == 1, srv.log()
    assert exited_after < 10
    log = srv.log()
    assert "the engine died" in log and "Traceback" not in log


@pytest.mark.slow
def test_sigterm_lets_streams_finish_then_ends_the_rest_and_exits_0(tiny_model_dir, tmp_path):
    srv = start_server(tiny_model_dir, str(tmp_path / "server.log"), "--served-model-name", "tiny",
                       "--shutdown-grace-period", "0.5")
    host, port = srv.url.removeprefix("http://").split(":")
    streams: list[list[str]] = [[] for _ in range(4)]
    readers = [threading.Thread(target=_stream_lines, args=(srv.url, 5 if i == 0 else 1000, lines))
               for i, lines in enumerate(streams)]
    try:
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + 30
        while not all(streams[1:]):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while True:  # the listening socket closes: new connections are refused
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
            except ConnectionRefusedError:
                break
            assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
            time.sleep(0.05)
        for reader in readers:
            reader.join(timeout=15)
        code = srv.proc.wait(timeout=15)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
    assert code == 0, srv.log()
    finished = [json.loads(line.removeprefix("data: ")) for line in streams[0][:-1]]
    assert streams[0][-1] == "data: [DONE]" and finished[-1]["choices"][0]["finish_reason"] == "length"
    for lines in streams[1:]:  # past the grace period: ended, each with an error event and [DONE]
        assert _error_then_done(lines)["code"] == "shutting_down"
    assert "Traceback" not in srv.log()
