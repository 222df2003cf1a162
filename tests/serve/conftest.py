"""Fixtures of the serve tests: a `vx serve` of the tiny model, started once per session as a subprocess, `openai`
clients for it, and a raw HTTP client. The plain helpers (starting a server, raw HTTP/1.1 over a socket) are in
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
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    """A raw HTTP client with the API key, for what the openai client hides (status codes, SSE bytes)."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def server_tokenizer(tiny_model_dir):
    """The session server's tokenizer, for token ids (logit_bias) and prompt lengths."""
    from vx.client.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_dir)
