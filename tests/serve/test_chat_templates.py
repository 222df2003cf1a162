"""Chat templates through `vx serve`: a request's own template only with --trust-request-chat-template, and no
template or prompt, however hostile or large, stalls the server's event loop (/health, other streams) or its memory."""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterator

import httpx
import psutil
import pytest
from tests.support.server import MODEL, Server, start_server, stop_server

TIMEOUT_S = 1.0  # the trusting server's --chat-template-timeout
START_ALLOWANCE_S = 10.0  # a killed renderer is replaced on the next render: imports take a second or more
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def trusting_server(tiny_model_dir, tmp_path_factory) -> Iterator[Server]:
    log_path = str(tmp_path_factory.mktemp("serve-templates") / "server.log")
    srv = start_server(tiny_model_dir, log_path, "--served-model-name", MODEL, "--max-model-len", "1024",
                       "--trust-request-chat-template", "--chat-template-timeout", str(TIMEOUT_S))
    yield srv
    stop_server(srv)


@pytest.fixture
def thttp(trusting_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=trusting_server.url, timeout=120) as c:
        yield c


class Watch:
    """While open, polls /health (recording each answer's latency) and samples the server's RSS."""

    def __init__(self, server: Server, also: Callable[[], None] | None = None) -> None:
        self.server = server
        self.also = also  # something else to keep doing meanwhile (another stream)
        self.health: list[float] = []
        self.rss_peak = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> "Watch":
        proc = psutil.Process(self.server.proc.pid)
        self.rss_before = proc.memory_info().rss

        def poll() -> None:
            with httpx.Client(base_url=self.server.url, timeout=30) as c:
                while not self._stop.is_set():
                    start = time.monotonic()
                    assert c.get("/health").status_code == 200
                    self.health.append(time.monotonic() - start)
                    self.rss_peak = max(self.rss_peak, proc.memory_info().rss)
                    time.sleep(0.05)

        self._threads.append(threading.Thread(target=poll))
        if self.also is not None:
            self._threads.append(threading.Thread(target=self._repeat, args=(self.also,)))
        for t in self._threads:
            t.start()
        return self

    def _repeat(self, fn: Callable[[], None]) -> None:
        while not self._stop.is_set():
            fn()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    @property
    def worst_health_s(self) -> float:
        assert len(self.health) >= 3, "too few /health answers to judge"
        return max(self.health)


def _chat(client: httpx.Client, template: str | None = None, messages=USER, **kw) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, **kw}
    if template is not None:
        body["chat_template"] = template
    return client.post("/v1/chat/completions", json=body)


def test_a_request_template_is_refused_without_the_flag(http):
    r = _chat(http, "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]
    assert err["type"] == "invalid_request_error"
    assert _chat(http).status_code == 200  # the server's own template still renders


def test_a_request_template_renders_as_transformers_does(thttp, tiny_model_dir):
    from vx.client.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    template = ("{{ bos_token }}{% for m in messages %}[{{ m.role | upper }}] {{ m.content | trim }}"
                "{% if not loop.last %}\n{% endif %}{% endfor %}{% if add_generation_prompt %}\n[BOT]{% endif %}")
    messages = [{"role": "system", "content": "  Be brief. "}, {"role": "user", "content": "Hello there"}]
    r = _chat(thttp, template, messages)
    assert r.status_code == 200, r.text
    want = tok.apply_chat_template(messages, chat_template=template, tokenize=True, add_generation_prompt=True,
                                   return_dict=False)
    assert r.json()["usage"]["prompt_tokens"] == len(want)
    assert _chat(thttp, "{{ raise_exception('no way') }}").json()["error"]["message"].endswith("no way")


@pytest.mark.parametrize("template, said", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "took longer than 1 s"),
    ("{% set x = 'a' * 1000000000 %}{{ x }}", "MiB"),
    ("{{ ''|center(1000000000) }}", "MiB"),
])
def test_hostile_templates_are_400s_and_the_server_stays_responsive(trusting_server, thttp, template, said):
    with Watch(trusting_server) as watch:
        time.sleep(0.2)
        start = time.monotonic()
        r = _chat(thttp, template)
        took = time.monotonic() - start
        time.sleep(0.2)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert said in err["message"] and err["param"] == "chat_template"
    assert took < TIMEOUT_S + START_ALLOWANCE_S
    assert watch.worst_health_s < 1.0
    assert watch.rss_peak - watch.rss_before < 64 * 2**20  # the 1 GB went nowhere near the server
    assert _chat(thttp, "{{ messages[0].content }}").status_code == 200  # a fresh renderer took over


@pytest.mark.parametrize("template", ["{{ ''.__class__.__mro__ }}", "{{ cycler.__init__.__globals__ }}"])
def test_sandbox_escapes_are_refused(thttp, template):
    r = _chat(thttp, template)
    assert r.status_code == 400 and "SecurityError" in r.json()["error"]["message"]


def test_a_5_mb_message_leaves_health_and_other_streams_alone(trusting_server, thttp):
    gaps: list[float] = []

    def other_stream() -> None:  # a short streamed completion; the longest wait for each next chunk counts
        with httpx.Client(base_url=trusting_server.url, timeout=60) as c:
            last = time.monotonic()
            with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Once upon a time",
                                                           "max_tokens": 16, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        now = time.monotonic()
                        gaps.append(now - last)
                        last = now

    big = "The quick brown fox jumps over the lazy dog. " * (5 * 2**20 // 45)
    with Watch(trusting_server, also=other_stream) as watch:
        time.sleep(0.5)
        streamed_before = len(gaps)
        r = _chat(thttp, messages=[{"role": "user", "content": big}])
        streamed_during = len(gaps) - streamed_before
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]  # processed: it is too long
    assert watch.worst_health_s < 1.0
    assert streamed_during > 0 and max(gaps) < 1.0
