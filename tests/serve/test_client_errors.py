"""A client's mistake on the chat and Responses paths is a 400 naming the field, never a 500: tools whose output
constraint is larger than structured outputs allow (a forced call, a named function, strict "auto" tools, many
strict tools; streaming or not), message roles OpenAI does not know, and stop token ids that leave no room for the
template's end-of-turn token."""

from __future__ import annotations

import pytest
from tests.support.server import MODEL

from vx.sampling_params import MAX_STOP_TOKEN_IDS, MAX_STRUCTURED_OUTPUTS_BYTES

MESSAGES = [{"role": "user", "content": "Hi"}]
# One tool's parameters past the constraint size limit (~190 KB), or many strict tools that pass it together.
BIG = {"type": "object", "properties": {"x": {"enum": [f"value-{i:06d}" for i in range(12000)]}}}
SMALL = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 20} for i in range(12)}}


def _chat_tool(name: str, parameters: dict, strict: bool | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters,
                                             **({"strict": strict} if strict is not None else {})}}


CHAT = [
    ("required", {"tools": [_chat_tool("f", BIG)], "tool_choice": "required"}, "tools.0.function.parameters"),
    ("named", {"tools": [_chat_tool("g", SMALL), _chat_tool("f", BIG)],
               "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools.1.function.parameters"),
    ("strict auto", {"tools": [_chat_tool("f", BIG, strict=True)], "tool_choice": "auto"}, "tools"),
    ("300 strict tools", {"tools": [_chat_tool(f"f{i}", SMALL, strict=True) for i in range(300)]}, "tools"),
    ("streaming required", {"tools": [_chat_tool("f", BIG)], "tool_choice": "required", "stream": True},
     "tools.0.function.parameters"),
]
RESPONSES = [
    ("required", {"tools": [{"type": "function", "name": "f", "parameters": BIG}], "tool_choice": "required"},
     "tools.0.parameters"),
    ("streaming named", {"tools": [{"type": "function", "name": "f", "parameters": BIG}], "stream": True,
                         "tool_choice": {"type": "function", "name": "f"}}, "tools.0.parameters"),
    ("strict auto", {"tools": [{"type": "function", "name": "f", "parameters": BIG, "strict": True}]}, "tools"),
]


@pytest.mark.parametrize("case, fields, param", CHAT, ids=[c[0] for c in CHAT])
def test_chat_tools_over_the_constraint_limit_are_a_400(http, case, fields, param):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ")
    assert f"at most {MAX_STRUCTURED_OUTPUTS_BYTES} bytes" in error["message"]


@pytest.mark.parametrize("case, fields, param", RESPONSES, ids=[c[0] for c in RESPONSES])
def test_responses_tools_over_the_constraint_limit_are_a_400(http, case, fields, param):
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ")  # the Responses API's names
    assert f"at most {MAX_STRUCTURED_OUTPUTS_BYTES} bytes" in error["message"]


def test_the_server_still_answers_a_tool_call_after_them(http):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 40,
                                                "tools": [_chat_tool("f", {"type": "object"})],
                                                "tool_choice": "required", "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}], "max_tokens": 2},
     "messages.0.role"),
    ("/v1/chat/completions", {"messages": [*MESSAGES, {"role": "User", "content": "Hi"}], "max_tokens": 2,
                              "stream": True}, "messages.1.role"),
    ("/v1/responses", {"input": [{"role": "wizard", "content": "Hi"}], "max_output_tokens": 2}, "input.0.role"),
    ("/v1/responses", {"input": [{"type": "message", "role": "tool", "content": "Hi"}], "max_output_tokens": 2},
     "input.0.role"),
])
def test_unknown_roles_are_a_400(http, path, body, param):
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "must be one of" in r.json()["error"]["message"]


def test_every_openai_chat_role_is_accepted(http):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Answer."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"},
                {"role": "function", "name": "f", "content": "42"}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_stop_token_ids_that_leave_no_room_for_the_end_of_turn_token_are_a_400(http):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2,
                                                "stop_token_ids": [1] * MAX_STOP_TOKEN_IDS})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stop_token_ids" and f"at most {MAX_STOP_TOKEN_IDS}" in r.text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
])
def test_a_bad_token_limit_is_named_as_the_client_sent_it(http, path, body, param):
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
