"""The OpenAI Responses API's request, and its items and response object as vx sends them.

Only what a text model with function tools can do is accepted: messages, function calls and their outputs as
input; function tools; `text.format` for structured output. Fields vx does not know are ignored, as in
protocol.py, so that newer clients keep working; ones it cannot honour (built-in tools, previous responses,
images) are refused with a 400 by responses.py.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`; tools, tool_choice and text stay plain JSON: responses.py checks and maps them."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None  # accepted; vx keeps no response (as store=false)
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's extras, as for chat
    top_k: int | None = None
    seed: int | None = None
    ignore_eos: bool | None = None


class ResponseObject(BaseModel):
    """The JSON answer's main fields, for the OpenAPI document (the answer itself is `response_object`'s)."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class ResponseStreamEvent(BaseModel):
    """One event of a streamed response, for the OpenAPI document: its type, its place, and its own fields."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """An assistant message item holding one output_text part."""
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)] if status == "completed" else []}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """Responses-API usage (input/output tokens, with the details clients read)."""
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


def response_object(req: ResponsesRequest, response_id: str, model: str, created_at: int | None = None, *,
                    status: str = "in_progress", output: list[dict[str, Any]] | None = None,
                    usage_info: dict[str, Any] | None = None, incomplete: str | None = None) -> dict[str, Any]:
    """The `response` object: what was asked (tools, settings) and, once done, the output and usage."""
    return {
        "id": response_id, "object": "response", "created_at": created_at or int(time.time()), "status": status,
        "model": model, "output": output or [], "usage": usage_info, "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "tools": req.tools or [],
        "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls is not False,
        "text": req.text or {"format": {"type": "text"}}, "metadata": req.metadata or {},
        "previous_response_id": None, "store": False, "truncation": "disabled", "user": req.user,
        "reasoning": {"effort": None, "summary": None},
    }
