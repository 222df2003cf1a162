"""OpenAI chat messages -> the model's prompt token ids, through its chat template.

OpenAI messages carry things many templates do not handle: content as a list of parts, `content: null` next to
`tool_calls`, `tool` results. They are normalized here so that any template renders them; for a template that
knows nothing of tools, the tool definitions go into the system message (Hermes style, which the tool-call
parser reads back) and earlier tool calls are written into the assistant's text the same way.
"""

from __future__ import annotations

import json
from typing import Any

from vx.client.chat import render_chat_prompt
from vx.serve.errors import bad_request
from vx.serve.protocol import ToolDefinition
from vx.serve.tool_parser import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

_TOOLS_SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], *, tools: list[ToolDefinition] | None,
                    chat_template: str | None, add_generation_prompt: bool = True) -> list[int]:
    """Render and tokenize the conversation; a 400 for messages or a template that cannot be rendered."""
    template = chat_template or getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):  # a tokenizer may keep several named templates
        template = " ".join(str(t) for t in (template.values() if isinstance(template, dict) else template))
    knows_tools = "tools" in template
    knows_tool_calls = "tool_calls" in template
    msgs = [_normalize(i, m, knows_tool_calls) for i, m in enumerate(messages)]
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    if tool_dicts and not knows_tools:
        msgs = _with_tools_in_system_message(msgs, tool_dicts)
        tool_dicts = None
    try:
        text = render_chat_prompt(tokenizer, msgs, tools=tool_dicts, add_generation_prompt=add_generation_prompt,
                                  chat_template=chat_template)
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    # The template wrote the special tokens (bos, turn markers) itself: do not add them again.
    return list(tokenizer.encode(text, add_special_tokens=False))


def _normalize(i: int, message: dict[str, Any], knows_tool_calls: bool) -> dict[str, Any]:
    if not isinstance(message.get("role"), str) or not message["role"]:
        raise bad_request(f"messages[{i}] needs a non-empty string 'role'.", f"messages.{i}.role")
    m = dict(message)
    content = m.get("content")
    if isinstance(content, list):
        m["content"] = _join_text_parts(i, content)
    elif content is not None and not isinstance(content, str):
        raise bad_request(f"messages[{i}].content must be a string or a list of parts.", f"messages.{i}.content")
    calls = m.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise bad_request(f"messages[{i}].tool_calls must be a list.", f"messages.{i}.tool_calls")
        calls = [_call_for_template(i, c) for c in calls]
        if knows_tool_calls:
            m["tool_calls"] = calls
        else:  # write them as the model would have, so that it sees its own earlier calls
            m.pop("tool_calls")
            text = "\n".join(f"{TOOL_CALL_OPEN}\n{json.dumps(c['function'], ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"
                             for c in calls)
            m["content"] = f"{m['content']}\n{text}" if m.get("content") else text
    if m.get("content") is None:
        m["content"] = ""  # most templates concatenate content as a string
    return m


def _join_text_parts(i: int, parts: list[Any]) -> str:
    texts = []
    for j, part in enumerate(parts):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}.",
                              f"messages.{i}.content")
    return "\n".join(texts)


def _call_for_template(i: int, call: Any) -> dict[str, Any]:
    """Templates expect `function.arguments` as a dict (they `tojson` it); OpenAI sends JSON text."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"messages[{i}].tool_calls entries need function.name.", f"messages.{i}.tool_calls")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise bad_request(f"messages[{i}].tool_calls: arguments are not valid JSON.",
                              f"messages.{i}.tool_calls") from None
    return {**call, "function": {"name": fn["name"], "arguments": args}}


def _with_tools_in_system_message(msgs: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    block = _TOOLS_SYSTEM_PROMPT.format(tools=listing)
    if msgs and msgs[0].get("role") == "system":
        first = dict(msgs[0])
        first["content"] = f"{first['content']}\n\n{block}" if first["content"] else block
        return [first] + msgs[1:]
    return [{"role": "system", "content": block}] + msgs
