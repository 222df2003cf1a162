"""Tool calls and JSON output through the `openai` client, with structured outputs doing the constraining.

The tiny random model writes nothing sensible on its own, so every test constrains it: `tool_choice="required"`
or a named function (the server builds the schema), `response_format`, or, for `tool_choice="auto"`, a regex
(vLLM's `structured_outputs` extra) that makes it write a Hermes `<tool_call>` the parser must find.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from tests.support.server import MODEL

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}, "dst": {"type": "boolean"}},
        "required": ["zone", "dst"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = dict(temperature=0.0, max_tokens=100)
HERMES_WEATHER = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|London)"\}\}</tool_call>'


def _check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _collect_stream(stream):
    """(content, tool calls as dicts, finish reason) of a one-choice chat stream."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_required_tool_choice_gives_a_valid_call(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, **GREEDY)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls)


def test_named_tool_choice_calls_that_function(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                         tool_choice={"type": "function", "function": {"name": "get_time"}}, **GREEDY)
    assert out.choices[0].finish_reason == "tool_calls"
    _check_calls(out.choices[0].message.tool_calls, names={"get_time"})


def test_streamed_required_tool_call(client):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, stream=True, **GREEDY)
    content, calls, finish = _collect_stream(stream)
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    assert calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])


@pytest.mark.parametrize("prefix", ["", "Let me check. "])
def test_auto_tool_choice_parses_a_hermes_call(client, prefix):
    regex = json.dumps(prefix)[1:-1].replace(".", r"\.") + HERMES_WEATHER
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, extra_body={"structured_outputs": {"regex": regex}},
                  **GREEDY)
    out = client.chat.completions.create(**kwargs)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert msg.content == (prefix.strip() or None)
    assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
    _check_calls(msg.tool_calls)

    content, calls, finish = _collect_stream(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" and content.strip() == prefix.strip()
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]


def test_tool_choice_none_returns_text(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                         extra_body={"structured_outputs": {"regex": HERMES_WEATHER}}, **GREEDY)
    assert not out.choices[0].message.tool_calls and "<tool_call>" in out.choices[0].message.content


def test_tool_history_renders(client):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
    ]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=3, temperature=0)
    assert out.usage.completion_tokens >= 1


def test_json_schema_response_format(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
              "required": ["answer", "sure"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}}
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt, **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    # the same through /v1/completions, streamed
    chunks = client.completions.create(model=MODEL, prompt="Answer:", stream=True, max_tokens=100, temperature=0,
                                       extra_body={"response_format": fmt})
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in chunks if c.choices)), schema)


@pytest.mark.parametrize("kwargs, param", [
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools.0.function.name"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs"),
    (dict(logprobs=False, top_logprobs=2), "top_logprobs"),
])
def test_bad_tool_and_format_requests_are_400s(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **kwargs)
    assert e.value.body["param"] == param


def test_n_choices_with_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="Hello", n=2, max_tokens=5, temperature=1.0, seed=7,
                                    logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1] and out.usage.completion_tokens == 10
    for c in out.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
        assert lp.text_offset[0] == 0
        if not any("\ufffd" in t for t in lp.tokens):  # a token alone may be part of a character
            assert "".join(lp.tokens) == c.text
        for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert logprob <= 0 and 1 <= len(top) <= 3  # the top 2 and the chosen one, by text
            if "\ufffd" not in tok:
                assert top[tok] == pytest.approx(logprob)

    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=4, temperature=1.0, seed=7,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert len(chat.choices) == 2
    for c in chat.choices:
        entries = c.logprobs.content
        assert len(entries) == 4
        if not any("\ufffd" in e.token for e in entries):
            assert "".join(e.token for e in entries) == c.message.content
        for e in entries:
            assert len(e.top_logprobs) == 3 and e.bytes == list(e.token.encode())
            assert e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob >= -1e9

    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=4, temperature=1.0,
                                            seed=7, stream=True, extra_body={"ignore_eos": True})
    texts: dict[int, str] = {0: "", 1: ""}
    finishes = {}
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert finishes == {0: "length", 1: "length"}
    assert texts == {c.index: c.message.content for c in chat.choices}  # same seed, same samples


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_cut_by_max_tokens_is_a_partial_call(client, tool_choice):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS[:1], tool_choice=tool_choice, temperature=0.0,
                  max_tokens=4)
    out = client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    with pytest.raises(json.JSONDecodeError):  # the arguments as far as they got: not yet JSON
        json.loads(call.function.arguments)
    whole = client.chat.completions.create(**{**kwargs, "max_tokens": 100}).choices[0].message.tool_calls[0]
    assert whole.function.arguments.replace(" ", "").startswith(call.function.arguments.replace(" ", ""))
    content, calls, finish = _collect_stream(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "length" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]


def test_no_tool_calls_means_no_tool_calls_field(http):
    body = http.post("/v1/chat/completions", json=dict(model=MODEL, messages=MESSAGES, max_tokens=2)).json()
    assert body["choices"][0]["message"].get("tool_calls") is None


def test_a_streamed_call_opens_with_null_content(http):
    with http.stream("POST", "/v1/chat/completions", json=dict(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", stream=True, logprobs=True,
            **GREEDY)) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert deltas[0]["role"] == "assistant" and deltas[0]["content"] is None
    assert any(d["tool_calls"] for d in deltas) and all(d.get("content") is None for d in deltas)
    assert any(c.get("logprobs") for e in events for c in e["choices"])  # logprobs come without content


_EMPTY_RANGE = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}}  # valid JSON
# schema, but no value fits: the engine's grammar compiler refuses it


def _tool(name, parameters):
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.mark.parametrize("kwargs, param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": _EMPTY_RANGE}}),
     "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}),
     "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/no"}}}),
     "response_format"),
    (dict(extra_body={"structured_outputs": {"regex": "(abc"}}), "structured_outputs"),
    (dict(extra_body={"guided_regex": "(?=a)b"}), "guided_regex"),
    (dict(tools=[_tool("f", _EMPTY_RANGE)], tool_choice="required"), "tools.0.function.parameters"),
    (dict(tools=[_tool("f", WEATHER), _tool("g", _EMPTY_RANGE)],
          tool_choice={"type": "function", "function": {"name": "g"}}), "tools.1.function.parameters"),
    (dict(tools=[_tool("f", {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}})]),
     "tools.0.function.parameters"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraints_are_400s_naming_their_field(client, kwargs, param, stream):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, stream=stream, **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    assert e.value.body["message"].startswith(param) and "structured_outputs" not in e.value.body["message"].replace(
        param, "")


VERDICT = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
           "additionalProperties": False}
VERDICT_FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}


def _first_char_bias(tokenizer, char):
    """A logit bias that makes the model open its reply with `char` (where the constraint allows it)."""
    return {str(tokenizer.convert_tokens_to_ids(char)): 100}


STRICT_TOOLS = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]


def test_auto_tools_with_a_response_format_may_call_a_tool_or_answer(client, server_tokenizer):
    # Strict tools and one call: the bias towards '<' would otherwise fill free argument strings and more calls.
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=STRICT_TOOLS, response_format=VERDICT_FORMAT,
                  parallel_tool_calls=False, **GREEDY)
    call = client.chat.completions.create(logit_bias=_first_char_bias(server_tokenizer, "<"), **kwargs).choices[0]
    assert call.finish_reason == "tool_calls" and call.message.content is None
    assert call.message.tool_calls and {c.function.name for c in call.message.tool_calls} <= set(SCHEMAS)
    answer = client.chat.completions.create(logit_bias=_first_char_bias(server_tokenizer, "{"), **kwargs).choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    jsonschema.validate(json.loads(answer.message.content), VERDICT)
    # the answer streams as it is generated: no tool call can begin with '{"a'
    stream = client.chat.completions.create(logit_bias=_first_char_bias(server_tokenizer, "{"), stream=True, **kwargs)
    pieces = [ch.delta.content for chunk in stream for ch in chunk.choices if ch.delta.content]
    assert len(pieces) >= 3 and "".join(pieces) == answer.message.content


def test_a_call_to_a_strict_tool_fits_its_parameters(client, server_tokenizer):
    for seed in range(3):
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=STRICT_TOOLS, temperature=1.0,
                                             seed=seed, max_tokens=100, response_format=VERDICT_FORMAT,
                                             parallel_tool_calls=False,
                                             logit_bias=_first_char_bias(server_tokenizer, "<"))
        assert out.choices[0].finish_reason == "tool_calls"
        _check_calls(out.choices[0].message.tool_calls)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_call_streams_its_arguments_as_they_are_written(http, client, tool_choice):
    body = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
                **GREEDY)
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    pieces = [tc for e in events for c in e["choices"] for tc in c["delta"].get("tool_calls") or []]
    assert pieces[0]["id"].startswith("call_") and pieces[0]["function"]["name"] in SCHEMAS
    assert len(pieces) >= 3 and all(p["index"] == 0 and p.get("id") is None for p in pieces[1:])
    arguments = "".join(p["function"]["arguments"] for p in pieces)
    whole = client.chat.completions.create(**body).choices[0].message.tool_calls[0]
    assert (pieces[0]["function"]["name"], json.loads(arguments)) == (whole.function.name,
                                                                     json.loads(whole.function.arguments))
