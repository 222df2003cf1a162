"""Fixtures of the serve tests: a `vx serve` of the tiny model, started once per session as a subprocess, `openai`
clients for it, and a raw HTTP client. `client` is parametrised: each test that takes it runs against the HTTP
server and against the in-process client (`vx.openai_client`, an engine of its own with the same settings), and
`http` then reaches the same app as `client`. The plain helpers (starting a server, raw HTTP/1.1 over a socket) are in
tests/support/server.py."""

from __future__ import annotations

from typing import Iterator

import httpx
import pytest

from tests.support.server import API_KEY, MODEL, Server, start_server, stop_server


@pytest.fixture(scope="session")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("serve")
    key_file = folder / "api-key"
    key_file.write_text(API_KEY + "\n")
    srv = start_server(tiny_model_dir, str(folder / "server.log"), "--api-key-file", str(key_file),
                       "--served-model-name", MODEL, "tiny-alias", "--max-model-len", "1024")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def inprocess_client(tiny_model_dir):
    """`vx.openai_client` (sync) over an engine of its own, served under the HTTP server's names and limits."""
    import vx

    client = vx.openai_client(vx.AsyncLLM(tiny_model_dir, max_model_len=1024), sync=True,
                              served_model_names=[MODEL, "tiny-alias"], timeout=120)
    yield client
    client.close()  # it started the engine (no event loop in the tests), so it stops it


@pytest.fixture(scope="session", params=["http", "in-process"])
def client(request):
    """The official `openai` client, over HTTP to `vx serve` or in-process."""
    if request.param == "in-process":
        return request.getfixturevalue("inprocess_client")
    import openai

    server = request.getfixturevalue("server")
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def http(request) -> Iterator[httpx.Client]:
    """A raw HTTP client with the API key, for what the openai client hides (status codes, SSE bytes); in a test
    that also takes `client`, it reaches the same app as that client."""
    if "client" in request.fixturenames and request.getfixturevalue("client").base_url.host == "vx.local":
        inner = request.getfixturevalue("client")._client  # the httpx (or httpx2) client of the in-process app
        yield type(inner)(transport=inner._transport, base_url="http://vx.local", timeout=120)  # never closed:
        return  # the transport belongs to the client
    server = request.getfixturevalue("server")
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def server_tokenizer(tiny_model_dir):
    """The session server's tokenizer, for token ids (logit_bias) and prompt lengths."""
    from vx.client.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_dir)
