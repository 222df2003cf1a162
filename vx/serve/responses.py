"""`POST /v1/responses`: OpenAI's Responses API (what openai-agents, pydantic-ai's OpenAIResponsesModel and
langchain's `use_responses_api` send), run through the chat path.

A Responses request is rewritten as a chat request (instructions -> a system message, input items -> messages,
flat function tools -> chat tools, `text.format` -> `response_format`) and handed to `create_chat_completion`, so
the prompt rendering, tool-call parsing, structured output, validation and metrics are the chat endpoint's
(its requests are counted under the chat endpoint's labels). Its answer is rewritten back: a message item and
function_call items, or, streaming, the Responses event sequence (response.created ... response.completed, each
with a `sequence_number`). Nothing is stored: `store` is accepted and `previous_response_id` is a 400.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from typing import Any, Iterator

import pydantic
from starlette.responses import Response
from starlette.types import Receive

from vx.serve.chat import create_chat_completion
from vx.serve.errors import APIError, bad_request
from vx.serve.protocol import ChatCompletionRequest
from vx.serve.responses_protocol import (ResponsesRequest, function_call_item, message_item, response_object,
                                         text_part, usage)
from vx.serve.state import ServerState
from vx.serve.streaming import Emit, EventStreamResponse

ENDPOINT = "/v1/responses"
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


async def create_response(state: ServerState, req: ResponsesRequest, receive: Receive) -> Response:
    """Answer `req` in the Responses shape (a 4xx `APIError` for what vx cannot or will not do)."""
    with state.metrics.errors_counted(ENDPOINT):  # the chat endpoint counts its own errors from here on
        chat = _chat_request(req)
    model = state.model_name(req.model)
    response_id = "resp_" + uuid.uuid4().hex
    with _responses_params():
        answer = await create_chat_completion(state, chat, receive)
    if not req.stream:
        if answer.status_code != 200:
            return answer
        return Response(json.dumps(_from_chat(req, response_id, model, json.loads(answer.body))),
                        media_type="application/json")
    assert isinstance(answer, EventStreamResponse)
    return EventStreamResponse(lambda emit: _ResponseStream(req, response_id, model, emit).run(answer))


@contextlib.contextmanager
def _responses_params() -> Iterator[None]:
    """An error the chat path raises names the field as the client sent it (`text.format`, not
    `response_format`)."""
    try:
        yield
    except APIError as e:
        param = e.param or ""
        if param == "response_format":
            e.param = "text.format"
        elif param == "max_completion_tokens":
            e.param = "max_output_tokens"
        elif param.startswith("messages"):
            e.param = "input"  # instructions shift the messages, so no index would be right
        elif param.startswith("tools.") and param.endswith(".function.parameters"):
            e.param = param.replace(".function.parameters", ".parameters")
        if param and e.param != param and e.message.startswith(param + ":"):  # a message that opens with the field
            e.message = f"{e.param}{e.message[len(param):]}"
        raise


# ----------------------------------------------------------------------------------------- request -> chat
def _chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    if req.previous_response_id is not None:
        raise bad_request("vx stores no responses, so previous_response_id cannot be used: send the whole "
                          "conversation as `input` (as with store=false).", "previous_response_id")
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        for i, item in enumerate(req.input):
            _add_item(messages, i, item)
    if not messages:
        raise bad_request("input holds no message.", "input")
    fields: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed,
        "ignore_eos": req.ignore_eos,
        "parallel_tool_calls": req.parallel_tool_calls, "stream": req.stream, "user": req.user,
        "tools": [_chat_tool(i, t) for i, t in enumerate(req.tools)] if req.tools else None,
        "tool_choice": _chat_tool_choice(req.tool_choice), "response_format": _response_format(req.text),
    }
    if req.stream:
        fields["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        raise bad_request(f"{'.'.join(map(str, err['loc']))}: {err['msg']}", str(err["loc"][0])) from None


def _add_item(messages: list[dict[str, Any]], i: int, item: dict[str, Any]) -> None:
    """Append input item `i` as chat messages: consecutive function calls join one assistant message."""
    kind = item.get("type", "message")
    if kind == "message":
        role = _ROLES.get(item["role"]) if isinstance(item.get("role"), str) else None
        if role is None:
            raise bad_request(f"input[{i}].role must be one of {', '.join(_ROLES)}.", f"input.{i}.role")
        messages.append({"role": role, "content": _text(item.get("content"), f"input.{i}.content")})
    elif kind == "function_call":
        name, arguments, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id", "")
        if not all(isinstance(v, str) for v in (name, arguments, call_id)):
            raise bad_request(f"input[{i}]: a function_call needs a name, arguments (JSON text) and a call_id.",
                              f"input.{i}")
        call = {"id": call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or not last["content"]):
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise bad_request(f"input[{i}]: a function_call_output needs the call_id of its call.", f"input.{i}")
        messages.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": _text(item.get("output"), f"input.{i}.output")})
    elif kind == "reasoning":
        return  # a reasoning model's earlier thoughts: not shown to the model again, as chat templates do
    else:
        raise bad_request(f"input[{i}] is a {kind!r} item; vx takes messages, function_call and "
                          "function_call_output items.", f"input.{i}.type")


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"),
                                                                                                     str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"{param}: only text parts are supported, got {kind!r}.", param)
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"{param} must be a string or a list of text parts.", param)


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise bad_request(f"tools[{i}] is a {tool.get('type')!r} tool; vx runs function tools only.",
                          f"tools.{i}.type")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise bad_request("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}.",
                          "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.get("type")}  # json_object, or what the chat endpoint refuses by name


# ----------------------------------------------------------------------------------------- chat -> response
def _from_chat(req: ResponsesRequest, response_id: str, model: str, chat: dict[str, Any]) -> dict[str, Any]:
    choice = chat["choices"][0]
    message = choice["message"]
    output = [message_item("msg_" + uuid.uuid4().hex, message["content"])] if message.get("content") else []
    output += [function_call_item("fc_" + uuid.uuid4().hex, call["id"], call["function"]["name"],
                                  call["function"]["arguments"]) for call in message.get("tool_calls") or []]
    u = chat["usage"]
    incomplete = "max_output_tokens" if choice["finish_reason"] == "length" else None
    return response_object(req, response_id, model, chat["created"], output=output,
                           status="incomplete" if incomplete else "completed",
                           usage_info=usage(u["prompt_tokens"], u["completion_tokens"]), incomplete=incomplete)


class _ResponseStream:
    """Turns the chat stream's chunks into the Responses event stream of one response."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str, emit: Emit) -> None:
        self.req, self.id, self.model, self.emit = req, response_id, model, emit
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None  # the message item being streamed
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> the function_call item being streamed
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.started = False

    async def run(self, chat: EventStreamResponse) -> None:
        with _responses_params():
            await chat.produce(self._on_chunk)
        await self._start()
        await self._close_message()
        await self._close_calls()
        incomplete = "max_output_tokens" if self.finish_reason == "length" else None
        await self._event("response.incomplete" if incomplete else "response.completed", response=response_object(
            self.req, self.id, self.model, status="incomplete" if incomplete else "completed", output=self.output,
            usage_info=self.usage, incomplete=incomplete))

    async def _event(self, kind: str, **fields: Any) -> None:
        await self.emit(json.dumps({"type": kind, "sequence_number": self.sequence, **fields}, ensure_ascii=False))
        self.sequence += 1

    async def _start(self) -> None:
        """The first events, sent with the chat stream's first chunk: an error found when the request is
        submitted still gets its 4xx status, as the status line goes out with the first event."""
        if not self.started:
            self.started = True
            await self._event("response.created", response=response_object(self.req, self.id, self.model))
            await self._event("response.in_progress", response=response_object(self.req, self.id, self.model))

    async def _on_chunk(self, data: str) -> None:
        await self._start()
        chunk = json.loads(data)
        if chunk.get("usage"):
            u = chunk["usage"]
            self.usage = usage(u["prompt_tokens"], u["completion_tokens"])
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                await self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                await self._function_call(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]

    async def _text_delta(self, text: str) -> None:
        if self.message is None:
            await self._close_calls()
            self.message = message_item("msg_" + uuid.uuid4().hex, "", status="in_progress")
            await self._event("response.output_item.added", output_index=len(self.output), item=self.message)
            await self._event("response.content_part.added", item_id=self.message["id"],
                              output_index=len(self.output), content_index=0, part=text_part(""))
        self.text.append(text)
        await self._event("response.output_text.delta", item_id=self.message["id"], output_index=len(self.output),
                          content_index=0, delta=text, logprobs=[])

    async def _close_message(self) -> None:
        if self.message is None:
            return
        text, item_id, index = "".join(self.text), self.message["id"], len(self.output)
        await self._event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                          text=text, logprobs=[])
        await self._event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                          part=text_part(text))
        done = message_item(item_id, text)
        await self._event("response.output_item.done", output_index=index, item=done)
        self.output.append(done)
        self.message, self.text = None, []

    async def _function_call(self, call: dict[str, Any]) -> None:
        """A chat tool-call delta: the first one of a call (its id and name) opens its item, the following ones
        carry its arguments piece by piece; calls come one after another."""
        fn = call.get("function") or {}
        index = call.get("index", 0)
        if call.get("id"):
            await self._close_message()
            await self._close_calls()
            item_id = "fc_" + uuid.uuid4().hex
            self.calls[index] = {"item_id": item_id, "call_id": call["id"], "name": fn.get("name", ""),
                                 "arguments": [], "output_index": len(self.output)}
            await self._event("response.output_item.added", output_index=len(self.output),
                              item=function_call_item(item_id, call["id"], fn.get("name", ""), "",
                                                      status="in_progress"))
        open_call = self.calls.get(index)
        if open_call is not None and fn.get("arguments"):
            open_call["arguments"].append(fn["arguments"])
            await self._event("response.function_call_arguments.delta", item_id=open_call["item_id"],
                              output_index=open_call["output_index"], delta=fn["arguments"])

    async def _close_calls(self) -> None:
        """The open calls' last events (their whole arguments, the finished item), in order."""
        for open_call in self.calls.values():
            arguments, item_id, index = "".join(open_call["arguments"]), open_call["item_id"], open_call["output_index"]
            await self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                              arguments=arguments)
            done = function_call_item(item_id, open_call["call_id"], open_call["name"], arguments)
            await self._event("response.output_item.done", output_index=index, item=done)
            self.output.append(done)
        self.calls.clear()
