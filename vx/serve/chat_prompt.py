"""OpenAI chat messages -> the model's prompt token ids, through its chat template, without blocking the event loop.

The template renders in a renderer process (vx/serve/template_sandbox.py: bounded in time, memory and output
size) and the text is tokenized in a worker thread (vx/serve/prompt_tokens.py).

OpenAI messages carry things many templates do not handle: content as a list of parts, `content: null` next to
`tool_calls`, `tool` results. They are normalized here so that any template renders them; for a template that
knows nothing of tools, the tool definitions go into the system message (Hermes style, which the tool-call
parser reads back) and earlier tool calls are written into the assistant's text the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio

from vx.serve.errors import APIError, bad_request
from vx.serve.protocol import ToolDefinition
from vx.serve.template_sandbox import RendererUnavailable, TemplateRenderError, TemplateSandbox
from vx.serve.prompt_tokens import encode_prompt, in_thread
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


# The message roles OpenAI's chat API takes ("function" is its older name for a tool's result); it refuses others.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# Template variables a request sets through its own fields, never through chat_template_kwargs.
_RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})


@dataclass
class ChatRender:
    """What the renderer gets: the resolved template, the normalized messages, the tools the template sees."""

    template: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


def prepare_chat(tokenizer: Any, messages: list[dict[str, Any]], *, tools: list[ToolDefinition] | None,
                 chat_template: str | None) -> ChatRender:
    """Normalize the messages and pick the template (`chat_template`, else the tokenizer's); a 400 for bad input."""
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
    try:  # transformers' choice among named templates ("tool_use" when there are tools, else "default")
        resolved = tokenizer.get_chat_template(chat_template, tool_dicts)
    except ValueError as e:
        raise bad_request(f"This model has no usable chat template: {e}", "messages") from None
    return ChatRender(resolved, msgs, tool_dicts)


async def chat_prompt_ids(sandbox: TemplateSandbox, tokenizer: Any, messages: list[dict[str, Any]], *,
                          tools: list[ToolDefinition] | None, chat_template: str | None, trusted: bool = True,
                          add_generation_prompt: bool = True, max_model_len: int | None = None,
                          tokenize_limiter: anyio.CapacityLimiter | None = None,
                          template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Render (in `sandbox`) and tokenize (in a worker thread) the conversation.

    `chat_template` overrides the tokenizer's; `trusted` is False when the request brought it; `template_kwargs`
    (the request's `chat_template_kwargs`) are extra template variables, as transformers passes them. A 400 for messages
    or a template that cannot be rendered, that hits one of the sandbox's limits, or whose prompt is too long for
    `max_model_len`; a 503 with no renderer.
    """
    chat = prepare_chat(tokenizer, messages, tools=tools, chat_template=chat_template)
    reserved = sorted(_RESERVED_VARIABLES.intersection(template_kwargs or {}))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}: the request's own fields do.",
                          "chat_template_kwargs")
    try:
        text = await sandbox.render(chat.template, chat.messages, tools=chat.tools,
                                    add_generation_prompt=add_generation_prompt,
                                    variables={**tokenizer.special_tokens_map, **(template_kwargs or {})},
                                    trusted=trusted)
    except TemplateRenderError as e:
        raise bad_request(str(e), "messages" if trusted else "chat_template") from None
    except RendererUnavailable as e:
        raise APIError(str(e), 503) from None
    # The template wrote the special tokens (bos, turn markers) itself: do not add them again.
    encode = partial(encode_prompt, tokenizer, text, add_special_tokens=False, max_model_len=max_model_len,
                     param="messages")
    return await in_thread(encode, tokenize_limiter)


def _normalize(i: int, message: dict[str, Any], knows_tool_calls: bool) -> dict[str, Any]:
    if not isinstance(message.get("role"), str) or not message["role"]:
        raise bad_request(f"messages[{i}] needs a non-empty string 'role'.", f"messages.{i}.role")
    if message["role"] not in CHAT_ROLES:
        raise bad_request(f"messages[{i}].role is {message['role']!r}; it must be one of {', '.join(CHAT_ROLES)}.",
                          f"messages.{i}.role")
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
    # As transformers' apply_chat_template does: templates test `'name' in message`, and a null is not a name.
    return {k: v for k, v in m.items() if v is not None}


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
