"""`/v1/responses` through the official `openai` client's `responses.create`, over HTTP and in-process: text,
its event stream, a function tool and the round trip of its output, structured output, and what vx refuses."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from tests.serve.test_tools_and_json import WEATHER
from tests.support.server import MODEL

TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER,
        "strict": True}
FORCED = {"type": "function", "name": "get_weather"}
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def _events(stream):
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_text_response_and_its_event_stream_agree(client):
    out = client.responses.create(model=MODEL, instructions="Be brief.", input="Hi there!", max_output_tokens=8,
                                  **GREEDY)
    assert out.object == "response" and out.id.startswith("resp_") and out.model == MODEL
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in out.output] == ["message"] and out.output_text
    assert out.usage.output_tokens == 8 and out.usage.input_tokens > 0
    assert out.usage.total_tokens == out.usage.input_tokens + 8

    events = _events(client.responses.create(model=MODEL, instructions="Be brief.", input="Hi there!",
                                              max_output_tokens=8, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == out.output_text
    assert events[-4].text == out.output_text and events[-2].item.content[0].text == out.output_text
    final = events[-1].response
    assert final.output_text == out.output_text and final.usage.output_tokens == 8


def test_function_call_and_the_round_trip_of_its_output(client):
    out = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[TOOL],
                                  tool_choice=FORCED, max_output_tokens=60, temperature=0.0)
    assert out.status == "completed"
    (call,) = out.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    history = [{"role": "user", "content": "What is the weather in Paris?"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    reply = client.responses.create(model=MODEL, input=history, tools=[TOOL], tool_choice="none",
                                    max_output_tokens=5, **GREEDY)
    assert [item.type for item in reply.output] == ["message"] and reply.output_text
    alone = client.responses.create(model=MODEL, input=history[:1], tools=[TOOL], tool_choice="none",
                                    max_output_tokens=1)
    assert reply.usage.input_tokens > alone.usage.input_tokens + 5  # the call and its output are in the prompt


def test_streamed_function_call_events(client):
    events = _events(client.responses.create(model=MODEL, input="Weather in London?", tools=[TOOL],
                                             tool_choice=FORCED, max_output_tokens=60, temperature=0.0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}  # the arguments, as they are generated
    added, (done, item_done, completed) = events[2], events[-3:]
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    assert "".join(e.delta for e in events[3:-3]) == done.arguments == item_done.item.arguments
    jsonschema.validate(json.loads(done.arguments), WEATHER)
    assert completed.response.output[0].call_id == added.item.call_id


def test_text_format_json_schema(client):
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    out = client.responses.create(model=MODEL, input=[{"role": "developer", "content": "Answer in JSON."},
                                                      {"role": "user", "content": [
                                                          {"type": "input_text", "text": "Weather in Paris?"}]}],
                                  text={"format": fmt}, max_output_tokens=60, temperature=0.0)
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), WEATHER)


@pytest.mark.parametrize("kwargs, param", [
    (dict(previous_response_id="resp_123"), "previous_response_id"),
    (dict(tools=[{"type": "web_search"}]), "tools.0.type"),
    (dict(input=[{"type": "input_image", "image_url": "x"}]), "input.0.type"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input.0.content"),
    (dict(tools=[TOOL], tool_choice={"type": "function", "name": "nope"}), "tool_choice"),
    (dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}), "text.format"),
    (dict(tools=[{**TOOL, "parameters": {"type": "nope"}}]), "tools.0.parameters"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_what_vx_cannot_do_is_a_400(client, kwargs, param, stream):
    kwargs = {"input": "Hi", **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, max_output_tokens=4, stream=stream, **kwargs)
    assert err.value.body["param"] == param
