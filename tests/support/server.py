"""A `vx serve` of a model as a subprocess on a free loopback port (started, stopped, its log kept), and raw
HTTP/1.1 over a socket for what no client library sends (half requests, bodies that never end). The serve tests'
fixtures (tests/serve/conftest.py) start their session server with these; tests that need a server of their own
call `start_server` / `stop_server` themselves."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

API_KEY = "sk-vx-test"
MODEL = "tiny"  # the served name; "tiny-alias" is the second one


@dataclasses.dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()[-4000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, log_path: str, *extra: str, timeout: float = 180.0) -> Server:
    """`python -m vx.cli serve` on a free loopback port; returns once /health answers 200."""
    port = free_port()
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "vx.cli", "serve", "--model", model_dir, "--port", str(port),
                             "--log-level", "warning", *extra], stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vx serve exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"vx serve did not become healthy in {timeout} s:\n{server.log()}")


def stop_server(server: Server) -> int:
    """SIGINT (as Ctrl-C), then the exit code; killed if it does not stop."""
    server.proc.send_signal(2)
    try:
        return server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
        raise


def metric(http_client: httpx.Client, name: str, labels: str = "") -> float:
    """One sample of GET /metrics (`labels` as written there, e.g. 'endpoint="/v1/completions"'); 0 if absent."""
    text = http_client.get("/metrics").text
    want = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def connect(server: Server, timeout: float = 10.0) -> socket.socket:
    """A TCP connection to the server, with a timeout on every operation."""
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


def request_head(method: str, path: str, headers: dict[str, str]) -> bytes:
    """An HTTP/1.1 request line and headers, up to the blank line."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@dataclasses.dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def read_response(sock: socket.socket) -> RawResponse:
    """One response with a Content-Length body (what error responses have) from `sock`."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return RawResponse(int(status_line.split()[1]), headers, body)
