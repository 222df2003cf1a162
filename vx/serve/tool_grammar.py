"""The output constraint of `tool_choice="auto"`: the model may call a tool or answer, and what it writes of either
is held to its schema.

Two things need it. `response_format` with tools: the reply is either content that fits the response schema or
tool calls, never content forced into the schema with no way to call a tool. And `strict: true` tools: a call to
one has arguments that fit its parameters. The constraint is an xgrammar structural tag (vx's
`StructuredOutputsParams.structural_tag`, vLLM's name), compiled by the engine like any other. Calls are written
in the Hermes format the tool parser reads and the tools' system prompt asks for (tool_parser.py).
"""

from __future__ import annotations

import json
from typing import Any

from vx.sampling_params import StructuredOutputsParams
from vx.serve.protocol import ResponseFormat, ToolDefinition
from vx.serve.tool_parser import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

# As the engine's plain JSON constraint: no free runs of whitespace, which a small model fills until max_tokens.
_MAX_WHITESPACE = 1
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def auto_tool_constraint(tools: list[ToolDefinition], response_format: ResponseFormat | None,
                         parallel: bool = True) -> StructuredOutputsParams | None:
    """The constraint for "auto" with these tools and this `response_format` (None, "text", "json_object" or
    "json_schema", already checked); None when nothing needs constraining (no response format, no strict tool)."""
    content = _content_schema(response_format)
    if content is None and not any(t.function.strict for t in tools):
        return None
    tags = [_call_tag(t) for t in tools]
    if content is None:  # free text, but a call once begun is a valid call
        fmt: dict[str, Any] = {"type": "triggered_tags", "triggers": [TOOL_CALL_OPEN], "tags": tags,
                               "stop_after_first": not parallel}
    else:
        calls = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                 "stop_after_first": not parallel}
        fmt = {"type": "or", "elements": [_json(content), calls]}
    return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": fmt},
                                                             ensure_ascii=False))


def _content_schema(response_format: ResponseFormat | None) -> dict[str, Any] | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object" or response_format.json_schema is None:
        return _ANY_OBJECT
    return response_format.json_schema.json_schema or _ANY_OBJECT


def _call_tag(tool: ToolDefinition) -> dict[str, Any]:
    """One call to `tool`: its arguments fit its parameters if the tool is strict, else any JSON object."""
    schema = (tool.function.parameters or {"type": "object", "properties": {}}) if tool.function.strict \
        else _ANY_OBJECT
    begin = f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(tool.function.name, ensure_ascii=False)}, "arguments": '
    return {"type": "tag", "begin": begin, "content": _json(schema), "end": f"}}\n{TOOL_CALL_CLOSE}"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": _MAX_WHITESPACE}
