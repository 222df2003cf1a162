"""Requests OpenAI refuses are refused here too, with a 400 naming the field: `max_tokens` past the context,
`stream_options` without `stream`, an empty `tools` list; and every response carries an `x-request-id`."""

from __future__ import annotations

import openai
import pytest
from tests.support.server import MODEL

MESSAGES = [{"role": "user", "content": "Hi"}]
MAX_MODEL_LEN = 1024  # the session server's (tests/serve/conftest.py)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_max_tokens_past_the_context_is_a_400(client, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, **{field: 100000})
    assert e.value.body["param"] == field
    message = e.value.body["message"]
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in message and "100000 in the completion" in message
    prompt = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1).usage.prompt_tokens
    with pytest.raises(openai.BadRequestError):  # one token too many
        client.chat.completions.create(model=MODEL, messages=MESSAGES, **{field: MAX_MODEL_LEN - prompt + 1})
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, **{field: 2})
    assert out.usage.completion_tokens <= 2


def test_completion_max_tokens_past_the_context_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=["Hi", "Hello there"], max_tokens=MAX_MODEL_LEN)
    assert e.value.body["param"] == "max_tokens" and "in the prompt" in e.value.body["message"]


def test_stream_options_need_stream(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                       stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stream_options={"include_usage": True})


def test_empty_tools_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, tools=[])
    assert e.value.body["param"] == "tools" and "too short" in e.value.body["message"]


def test_responses_carry_the_request_id(http):
    ok = http.post("/v1/chat/completions", json=dict(model=MODEL, messages=MESSAGES, max_tokens=1),
                   headers={"x-request-id": "trace-42"})
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "trace-42"
    bad = http.post("/v1/chat/completions", json=dict(model=MODEL, messages=MESSAGES, max_tokens=-1))
    assert bad.status_code == 400 and len(bad.headers["x-request-id"]) == 32
    other = http.get("/v1/models")
    assert other.headers["x-request-id"] != bad.headers["x-request-id"]
    unauthorized = http.get("/v1/models", headers={"Authorization": "Bearer wrong", "x-request-id": "abc"})
    assert unauthorized.status_code == 401 and unauthorized.headers["x-request-id"] == "abc"


def test_a_stream_carries_the_request_id(http):
    with http.stream("POST", "/v1/chat/completions", json=dict(model=MODEL, messages=MESSAGES, max_tokens=2,
                                                               stream=True), headers={"x-request-id": "s-1"}) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "s-1"
        r.read()
    odd = http.get("/v1/models", headers={"x-request-id": "\x7f" * 3})  # not printable: replaced
    assert len(odd.headers["x-request-id"]) == 32
