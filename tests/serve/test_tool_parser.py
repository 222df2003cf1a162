"""Tool-call parsing (auto), its streaming hold-back, and the schemas that force a call."""

from __future__ import annotations

import json

import jsonschema
import pytest

from vx.serve.protocol import NamedToolChoice, ToolDefinition
from vx.serve.tool_parser import (ToolCallStreamBuffer, bare_call_start, forced_tool_calls, forced_tool_schema,
                                  parse_tool_calls)

NAMES = {"get_weather", "get_time"}


def _calls(text):
    content, calls = parse_tool_calls(text, NAMES)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    ('Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>', "Let me look.",
     [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]),
    # cut by max_tokens after a complete object: still a call
    ('<tool_call>{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),
    ('  {"name": "get_weather", "parameters": {"city": "Rome"}}  ', None, [("get_weather", {"city": "Rome"})]),
    ('[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {}}]', None,
     [("get_weather", {"city": "Rome"}), ("get_time", {})]),
])
def test_tool_calls_are_found(text, content, calls):
    assert _calls(text) == (content, calls)


@pytest.mark.parametrize("text", [
    "Paris is sunny today.",
    '{"city": "Paris"}',  # JSON, but not a call
    '{"name": "launch_missiles", "arguments": {}}',  # not one of the tools
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # bad JSON
    '<tool_call>{"name": "get_weather", "arguments": 3}</tool_call>',
    'Use {"name": "get_weather", "arguments": {}} like this',  # a bare call must be the whole reply
])
def test_text_that_is_not_a_call_stays_content(text):
    assert parse_tool_calls(text, NAMES) == (text, [])


def _stream(text, step=1):
    buf = ToolCallStreamBuffer(NAMES)
    sent = [buf.feed(text[i:i + step]) for i in range(0, len(text), step)]
    rest, calls = buf.finish()
    return "".join(sent), rest, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_stream_buffer_releases_text_before_a_call_and_holds_the_call(step):
    text = 'Checking <tool > now.\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call> ok'
    sent, rest, calls = _stream(text, step)
    assert sent == "Checking <tool > now.\n"
    assert rest == "ok" and calls == [("get_time", {"zone": "UTC"})]


@pytest.mark.parametrize("text", ["Just words, no calls at all. <tool", '{"city": "Paris"}', "   ", "<tool_c"])
def test_stream_buffer_gives_back_everything_when_there_is_no_call(text):
    for step in (1, 4):
        sent, rest, calls = _stream(text, step)
        assert sent + rest == text and calls == []


def test_stream_buffer_holds_a_bare_json_call():
    sent, rest, calls = _stream(' {"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert sent == "" and rest == "" and calls == [("get_weather", {"city": "Oslo"})]


def test_json_content_streams_as_it_comes():
    text = '{"answer": "yes", "name": "get_weather"}'
    buf = ToolCallStreamBuffer(NAMES)
    sent = [buf.feed(ch) for ch in text]
    assert "".join(sent[:2]) == "" and "".join(sent[:3]) == '{"a'  # held only while it can be '{"name"'
    assert "".join(sent) + buf.finish()[0] == text


@pytest.mark.parametrize("text, state", [
    ("", "maybe"), ("  [", "maybe"), ('{"na', "maybe"), ('[ {"name" : "get_', "maybe"), ('{"name": "get_time"', "call"),
    ('{"name": "bob"', "no"), ('{"city"', "no"), ("[1, 2]", "no"), ("Hi", "no"), ('{"name": 3', "no"),
])
def test_bare_call_start(text, state):
    assert bare_call_start(text, NAMES) == state


TOOLS = [ToolDefinition.model_validate(t) for t in [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]]


def test_required_schema_accepts_exactly_lists_of_calls():
    schema = forced_tool_schema(TOOLS, "required").json
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}},
                         {"name": "get_time", "parameters": {}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "nope", "parameters": {}}], {}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = forced_tool_schema(TOOLS, "required", parallel=False).json
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, one)


def test_required_schema_keeps_each_tools_own_refs():
    # A tool's `$ref`s point into its own schema; under "required" they must still find their target.
    tools = [ToolDefinition.model_validate({"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/x"}}, "required": ["x"],
        "$defs": {"x": {"type": kind}}}}}) for n, kind in (("f", "string"), ("g", "integer"))]
    schema = forced_tool_schema(tools, "required").json
    jsonschema.validate([{"name": "f", "parameters": {"x": "a"}}, {"name": "g", "parameters": {"x": 1}}], schema)
    for bad in ([{"name": "f", "parameters": {"x": 1}}], [{"name": "g", "parameters": {"x": "a"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_named_schema_is_the_functions_parameters():
    choice = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})
    assert forced_tool_schema(TOOLS, choice).json == TOOLS[0].function.parameters
    calls = forced_tool_calls('{"city": "Paris"}', choice)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    cut = forced_tool_calls('{"city": "Par', choice)  # cut short: the arguments as far as they got
    assert [(c.name, c.arguments) for c in cut] == [("get_weather", '{"city": "Par')]


def test_forced_output_parses_into_calls():
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]'
    calls = forced_tool_calls(text, "required")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {}), ("get_weather", {"city": "Rome"})]
    assert len({c.id for c in calls}) == 2




@pytest.mark.parametrize("text, calls", [
    ("", [("get_time", "")]),  # nothing yet: the one tool it can be
    ('[{"name": "get_', [("get_time", "")]),
    ('[{"name": "get_time", "parameters": {"zone": "U', [("get_time", '{"zone": "U')]),
    ('[{"name":"get_time","parameters":{}}', [("get_time", "{}")]),
    ('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {', [
        ("get_time", "{}"), ("get_weather", "{")]),
    ('[{"name": "get_', [("get_", "")]),  # two tools fit: the name as far as it got
])
def test_a_cut_required_reply_gives_its_calls_so_far(text, calls):
    names = ["get_time"] if calls[0][0] == "get_time" and len(calls) == 1 else sorted(NAMES)
    assert [(c.name, c.arguments) for c in forced_tool_calls(text, "required", names)] == calls
