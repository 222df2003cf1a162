"""`vx serve` as a process: loopback by default, no torch in the server, JSON mode on the default model, and a
clean stop (the engine process goes with it)."""

from __future__ import annotations

import json
import os

import openai
import psutil
import pytest
from conftest import start_server, stop_server


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


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_engine_death_fails_requests_fast(tiny_model_dir, tmp_path):
    import time

    import httpx

    srv = start_server(tiny_model_dir, str(tmp_path / "server.log"), "--served-model-name", "tiny")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(model="tiny", prompt="Hi", max_tokens=1000, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        engines = [c for c in psutil.Process(srv.proc.pid).children(recursive=True) if _maps_torch(c.pid)]
        assert len(engines) == 1
        engines[0].kill()
        with pytest.raises(openai.APIError, match="engine"):  # the open stream ends with an error event
            for _ in stream:
                pass
        deadline = time.monotonic() + 30
        while httpx.get(srv.url + "/health").status_code != 503:
            assert time.monotonic() < deadline, "/health still 200 with the engine dead"
            time.sleep(0.1)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="tiny", prompt="Hi", max_tokens=4)
        assert e.value.status_code == 503
    finally:
        stop_server(srv)
