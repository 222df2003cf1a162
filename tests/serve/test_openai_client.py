"""The official `openai` client against `vx serve` (tiny random model): completions, chat, streaming, errors."""

from __future__ import annotations

import httpx
import openai
import pytest
from tests.support.server import API_KEY, MODEL, metric

GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def test_models_lists_the_served_names(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL, "tiny-alias"]
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_models_name_no_filesystem_path(http, tiny_model_dir):
    listing = http.get("/v1/models")
    assert [m["root"] for m in listing.json()["data"]] == [MODEL, MODEL]  # the model behind each alias
    assert tiny_model_dir not in listing.text


def test_completion_and_its_stream_agree(client):
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, **GREEDY)
    choice = out.choices[0]
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    assert choice.finish_reason == "length" and choice.text
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8

    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                            stream=True, stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_completion_prompt_forms(client, tokenizer_of_server):
    ids = tokenizer_of_server.encode("Hello, world!", add_special_tokens=True)
    by_text = client.completions.create(model=MODEL, prompt="Hello, world!", max_tokens=5, **GREEDY)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=["Hello, world!", "The weather in London"],
                                      max_tokens=5, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    assert batch.usage.completion_tokens == 10
    echo = client.completions.create(model=MODEL, prompt="Hello, world!", max_tokens=5, echo=True, **GREEDY)
    assert echo.choices[0].text == "Hello, world!" + by_text.choices[0].text


def test_batch_stream_interleaves_choices(client):
    chunks = list(client.completions.create(model=MODEL, prompt=["Hello", "Once upon a time"], max_tokens=6,
                                            stream=True, **GREEDY))
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    single = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, **GREEDY)
    assert texts[1] == single.choices[0].text


def test_stop_string_ends_the_completion(client):
    full = client.completions.create(model=MODEL, prompt="Hello", max_tokens=20, **GREEDY).choices[0].text
    stop = full.strip()[2:4] if len(full.strip()) >= 4 else None
    if not stop or stop not in full:
        pytest.skip("the tiny model's text has no usable stop string")
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=20, stop=[stop], **GREEDY)
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == full[:full.index(stop)]


def test_chat_and_its_stream_agree(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **GREEDY)
    msg = out.choices[0].message
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert msg.role == "assistant" and msg.content and not msg.tool_calls
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_content_parts_and_max_completion_tokens(client):
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there!"}]
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],
                                         max_completion_tokens=3, **GREEDY)
    assert out.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert "text parts" in e.value.body["message"]


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(extra_body={"top_k": -5}), "top_k"),
    (dict(logit_bias={"not-a-token": 1}), "logit_bias"),
    (dict(logit_bias={"99999": 1}), None),
    (dict(extra_body={"response_format": {"type": "json_schema"}}), "response_format"),
])
def test_bad_params_are_400s_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", **{"max_tokens": 4, **kwargs})
    assert e.value.status_code == 400
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["message"]
    if param is not None:
        assert e.value.body["param"] == param


def test_prompt_too_long_and_unknown_model(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * 1024, max_tokens=4)
    assert "max_model_len" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["code"] == "model_not_found"


def test_error_bodies_have_openai_shape(http):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True, "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"  # not a 200 stream


def test_api_key_is_required_on_v1_only(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    ok = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200


def test_metrics_count_requests_tokens_and_latency(client, http):
    before = {name: metric(http, name, 'endpoint="/v1/chat/completions"')
              for name in ("vx_generation_tokens_total", "vx_time_to_first_token_seconds_count",
                           "vx_inter_token_latency_seconds_count", "vx_prompt_tokens_total")}
    done = metric(http, "vx_requests_total", 'endpoint="/v1/chat/completions",finish_reason="length"')
    errors = metric(http, "vx_requests_total", 'endpoint="/v1/chat/completions",finish_reason="error"')
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                         **GREEDY)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], top_p=0)
    chat = 'endpoint="/v1/chat/completions"'
    assert metric(http, "vx_generation_tokens_total", chat) - before["vx_generation_tokens_total"] == 5
    assert metric(http, "vx_prompt_tokens_total", chat) - before["vx_prompt_tokens_total"] == out.usage.prompt_tokens
    assert metric(http, "vx_time_to_first_token_seconds_count", chat) - \
        before["vx_time_to_first_token_seconds_count"] == 1
    # One per later token, except tokens that reached the server together with the first (under load).
    assert 1 <= metric(http, "vx_inter_token_latency_seconds_count", chat) - \
        before["vx_inter_token_latency_seconds_count"] <= 4
    assert metric(http, "vx_requests_total", chat + ',finish_reason="length"') == done + 1
    assert metric(http, "vx_requests_total", chat + ',finish_reason="error"') == errors + 1
    text = http.get("/metrics").text
    for gauge in ("vx_kv_blocks_total", "vx_kv_blocks_in_use", "vx_kv_cache_usage_ratio", "vx_prefix_cache_hit_rate",
                  "vx_num_requests_running", "vx_num_requests_waiting"):
        assert f"\n{gauge} " in text
    assert metric(http, "vx_kv_blocks_total") > 0


def test_prefix_cache_hit_rate_rises_on_a_repeated_prompt(client, http):
    prompt = "In 2024, the meeting started at 10:30 and ended at 12:45. " * 4
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    rate = metric(http, "vx_prefix_cache_hit_rate")
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    assert metric(http, "vx_prefix_cache_hit_rate") > rate


def _wait_idle(http: httpx.Client, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(http, "vx_kv_blocks_in_use") == 0 and metric(http, "vx_num_requests_running") == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"KV blocks still in use after {timeout} s: {metric(http, 'vx_kv_blocks_in_use')}")


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_dropping_a_stream_aborts_it_and_frees_its_blocks(client, http, endpoint):
    _wait_idle(http)
    label = f'endpoint="{endpoint}",finish_reason="abort"'
    aborted = metric(http, "vx_requests_total", label)
    kwargs = dict(model=MODEL, max_tokens=1000, stream=True, **GREEDY)
    if endpoint == "/v1/completions":
        stream = client.completions.create(prompt="Once upon a time", **kwargs)
    else:
        stream = client.chat.completions.create(messages=[{"role": "user", "content": "Tell a story"}], **kwargs)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    assert metric(http, "vx_kv_blocks_in_use") > 0  # the request is still generating
    stream.close()  # drops the connection
    _wait_idle(http)
    assert metric(http, "vx_requests_total", label) == aborted + 1


def test_dropping_a_plain_request_aborts_it(server, http):
    import json
    import socket
    import time
    from urllib.parse import urlsplit

    _wait_idle(http)
    label = 'endpoint="/v1/completions",finish_reason="abort"'
    aborted = metric(http, "vx_requests_total", label)
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1000, "ignore_eos": True}).encode()
    url = urlsplit(server.url)
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: " +
                     str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while metric(http, "vx_kv_blocks_in_use") == 0:  # wait until it generates, then hang up
            assert time.monotonic() < deadline
            time.sleep(0.01)
    _wait_idle(http)
    assert metric(http, "vx_requests_total", label) == aborted + 1


@pytest.fixture(scope="module")
def tokenizer_of_server(tiny_model_dir):
    from vx.client.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_dir)
