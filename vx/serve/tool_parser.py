"""Tool calls: find them in a model's text (`tool_choice="auto"`), or force them with a JSON schema.

With "auto" the model writes tool calls as text: Hermes style `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` (Qwen, Hermes, SmolLM and most ChatML models), or a bare JSON object (or list of them) that
opens with `"name"`, then `arguments` (Llama 3 style, which also says `parameters`). With "required" or a named
function, the output is constrained by structured outputs to a JSON schema built from the tools' parameter
schemas, so the reply is always a valid call, or, cut short by max_tokens, the start of one (read as a partial
call, as OpenAI returns it).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from vx.sampling_params import StructuredOutputsParams
from vx.serve.protocol import NamedToolChoice, ToolDefinition

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_HERMES = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|\Z)", re.DOTALL)


@dataclass
class ParsedToolCall:
    """One call: the function's name and its arguments as JSON text (as OpenAI sends them)."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = new_call_id()


def new_call_id() -> str:
    """A tool call's id, in OpenAI's style."""
    return "call_" + uuid.uuid4().hex[:24]


def parse_tool_calls(text: str, tool_names: set[str]) -> tuple[str | None, list[ParsedToolCall]]:
    """Split a model's reply into (content, tool calls). A call must name one of `tool_names`; text that only
    looks like a call (bad JSON, unknown function) stays content, so nothing the model wrote is lost."""
    if TOOL_CALL_OPEN in text:
        calls = []
        for match in _HERMES.finditer(text):
            call = _call_from_json(match.group(1).strip(), tool_names)
            if call is None or isinstance(call, list):
                return text, []
            calls.append(call)
        content = _HERMES.sub("", text).strip()
        return content or None, calls
    stripped = text.strip()
    if bare_call_start(stripped, tool_names) == "call":
        found = _call_from_json(stripped, tool_names)
        if found is not None:
            return None, found if isinstance(found, list) else [found]
    return text, []


def bare_call_start(text: str, tool_names: set[str]) -> str:
    """Whether `text` opens a bare JSON call, `{"name": "<a tool>"` (or a list of calls, `[{"name": ...`), the
    format `parse_tool_calls` reads: "call" when it does, "maybe" while it still can, "no" once it cannot."""
    i, n = 0, len(text)
    for literal in ("[", "{", '"name"', ":", '"'):
        while i < n and text[i].isspace():
            i += 1
        if i == n:
            return "maybe"
        if literal == "[" and text[i] != "[":
            continue  # a single call: the list bracket is optional
        if not text.startswith(literal, i):
            return "maybe" if literal.startswith(text[i:]) else "no"
        i += len(literal)
    end = text.find('"', i)
    if end < 0:
        return "maybe" if any(name.startswith(text[i:]) for name in tool_names) else "no"
    return "call" if text[i:end] in tool_names else "no"


def _call_from_json(raw: str, tool_names: set[str]) -> ParsedToolCall | list[ParsedToolCall] | None:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if isinstance(obj, list):
        calls = [_call_from_obj(o, tool_names) for o in obj]
        return calls if calls and all(c is not None for c in calls) else None  # type: ignore[return-value]
    return _call_from_obj(obj, tool_names)


def _call_from_obj(obj: Any, tool_names: set[str]) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in tool_names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


class ToolCallStreamBuffer:
    """Streams the content of an "auto" reply while holding back whatever may turn out to be a tool call.

    Text before a `<tool_call>` tag streams at once; from the tag on (or from a bare JSON call that opens the
    reply, `{"name": "<a tool>"`) everything is held until the end, where `finish` parses it. A reply is held
    only while it can still become a call: JSON content such as `{"answer": ...}` streams as it comes.
    """

    def __init__(self, tool_names: set[str]) -> None:
        self.tool_names = tool_names
        self.text = ""
        self.sent = 0  # characters of `text` already released as content
        self.holding = False  # a possible call began: release nothing more until `finish`

    def feed(self, delta: str) -> str:
        """Add generated text; return the content that is safe to send now."""
        self.text += delta
        if self.holding:
            return ""
        if self.sent == 0:
            head = self.text.lstrip()
            if not head or (len(head) < len(TOOL_CALL_OPEN) and TOOL_CALL_OPEN.startswith(head)):
                return ""  # too early to tell
            if head.startswith(TOOL_CALL_OPEN):
                self.holding = True
                return ""
            opening = bare_call_start(head, self.tool_names)
            if opening != "no":
                self.holding = opening == "call"
                return ""
        pending = self.text[self.sent:]
        tag = pending.find(TOOL_CALL_OPEN)
        if tag >= 0:
            cut, self.holding = tag, True
        else:  # keep back a suffix that may be the start of a tag
            cut = len(pending)
            for k in range(min(len(TOOL_CALL_OPEN) - 1, len(pending)), 0, -1):
                if TOOL_CALL_OPEN.startswith(pending[-k:]):
                    cut -= k
                    break
        self.sent += cut
        return pending[:cut]

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """At the end of the reply: (content not sent yet, tool calls)."""
        held, self.sent = self.text[self.sent:], len(self.text)
        content, calls = parse_tool_calls(held, self.tool_names)
        if not calls:
            return held, []
        return content or "", calls


# ---------------------------------------------------------------------------------------------- forcing
def forced_tool_schema(tools: list[ToolDefinition], tool_choice: str | NamedToolChoice,
                       parallel: bool = True) -> StructuredOutputsParams:
    """The constraint for `tool_choice="required"` (a non-empty JSON list of calls to any tool; one call only
    when `parallel` is False) or for a named function (a JSON object: that function's arguments)."""
    if isinstance(tool_choice, NamedToolChoice):
        tool = _find(tools, tool_choice.function.name)
        return StructuredOutputsParams(json=_parameters(tool))
    # Each tool's schema goes under `$defs`, its own `$ref`s ("#/...") rewritten to point where it now lies:
    # placed inline, they would point into the combined schema instead.
    defs = {f"tool_{i}": _relocated(_parameters(t), f"#/$defs/tool_{i}") for i, t in enumerate(tools)}
    variants = [{
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [t.function.name]},
                       "parameters": {"$ref": f"#/$defs/tool_{i}"}},
        "required": ["name", "parameters"],
    } for i, t in enumerate(tools)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}, "$defs": defs}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def forced_tool_calls(text: str, tool_choice: str | NamedToolChoice,
                      tool_names: list[str] | None = None) -> list[ParsedToolCall]:
    """The calls in a reply generated under `forced_tool_schema`, arguments as compact JSON. A reply cut short
    (by max_tokens) still gives its calls, the last one with the arguments text written so far, as OpenAI sends
    a cut call (see `forced_call_texts`)."""
    return [ParsedToolCall(name=c.name, arguments=_compact(c.arguments))
            for c in forced_call_texts(text, tool_choice, tool_names or [])]


@dataclass
class CallText:
    """One call of a forced reply as written so far: its name and the raw text of its arguments."""

    name: str
    arguments: str
    name_complete: bool  # False: `name` is the one tool the cut name can still be, else what was written of it


# One call of a "required" reply, as the schema orders it: {"name": "...", "parameters": ...; either may be cut.
_CUT_NAME = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)(")?')
_CUT_ARGUMENTS = re.compile(r'\s*,\s*"parameters"\s*:\s*', re.DOTALL)


def forced_call_texts(text: str, tool_choice: str | NamedToolChoice, tool_names: list[str]) -> list[CallText]:
    """The calls of a (possibly unfinished) reply generated under `forced_tool_schema`: for a named function the
    whole reply is its arguments; for "required", a JSON list of `{"name": ..., "parameters": ...}`, whose
    complete items come first and then the one it stopped in. Each call's arguments text only grows as the reply
    does, so a stream can send the difference."""
    if isinstance(tool_choice, NamedToolChoice):
        return [CallText(tool_choice.function.name, text, True)]
    decoder = json.JSONDecoder()
    body = text.lstrip()
    pos = 1 if body.startswith("[") else 0
    calls: list[CallText] = []
    while True:
        rest = body[pos:].lstrip().removeprefix(",").lstrip()
        if (rest and not rest.startswith("{")) or (not rest and calls):
            return calls  # the end of the list (or not a call at all), or a reply cut between two calls
        try:
            item, end = decoder.raw_decode(rest)
        except json.JSONDecodeError:
            calls.append(_call_text(rest, None, tool_names))
            return calls
        calls.append(_call_text(rest[:end], item, tool_names))
        pos = len(body) - len(rest) + end


def _call_text(written: str, item: Any, tool_names: list[str]) -> CallText:
    """One call from its text; `item` is that text parsed, None while it is unfinished."""
    named = _CUT_NAME.match(written)
    if named is None or named.group(2) is None:  # the name itself was cut: complete it where only one tool fits
        name = named.group(1) if named is not None else ""
        fits = [t for t in tool_names if t.startswith(name)]
        return CallText(fits[0] if len(fits) == 1 else name, "", False)
    after = _CUT_ARGUMENTS.match(written, named.end())
    arguments = written[after.end():] if after is not None else ""
    if item is not None:  # the call's own closing brace follows its arguments
        arguments = arguments.rstrip().removesuffix("}").rstrip()
    name = item["name"] if isinstance(item, dict) and isinstance(item.get("name"), str) else named.group(1)
    return CallText(name, arguments, True)


def _compact(arguments: str) -> str:
    """Arguments text as OpenAI sends it: compact JSON when complete, else as written (cut, or not JSON)."""
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False)
    except json.JSONDecodeError:
        return arguments


def _find(tools: list[ToolDefinition], name: str) -> ToolDefinition:
    for t in tools:
        if t.function.name == name:
            return t
    raise KeyError(name)


def _parameters(tool: ToolDefinition) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _relocated(schema: Any, base: str) -> Any:
    """A copy of `schema` whose `$ref`s to places inside it ("#/a/b") point below `base` ("<base>/a/b")."""
    if isinstance(schema, list):
        return [_relocated(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _relocated(value, base) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):  # a JSON pointer into the schema
        out["$ref"] = base + ref[1:]
    return out
