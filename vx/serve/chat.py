"""`POST /v1/chat/completions`: chat through the model's template, with tool calls and JSON output.

`tool_choice` decides how a reply is read: "none" (plain content), "auto" (content, unless the model wrote
tool calls, which are parsed out; constrained by tool_grammar.py when a response_format or a strict tool asks),
"required" or a named function (the output is constrained to a call, see tool_parser.py). With a reasoning
parser, a think block is read out first (reasoning.py). Streaming sends reasoning and content as they come, a
forced call's arguments as they are written, and the calls of an "auto" reply as one delta at its end.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable

from starlette.responses import Response
from starlette.types import Receive

from vx.client.chat import chat_sampling_params
from vx.outputs import CompletionOutput, RequestOutput
from vx.sampling_params import MAX_LOGPROBS, StructuredOutputsParams
from vx.serve.chat_prompt import chat_prompt_ids
from vx.serve.errors import APIError, bad_request
from vx.serve.generation import Choice, EngineJob, constraint_error, make_jobs, now, run_jobs
from vx.serve.logprobs import chat_logprobs
from vx.serve.params import check_context_length, check_request_shape, output_constraint, sampling_params
from vx.serve.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                               ChatLogprobs, ChatMessage, ChatStreamChoice, DeltaFunctionCall, DeltaMessage,
                               DeltaToolCall, FunctionCall, NamedToolChoice, ToolCall, UsageInfo)
from vx.serve.reasoning import THINK_OPEN, ReasoningSplitter, reasoning_enabled, starts_inside
from vx.serve.request_limits import (check_logprob_entries, check_request_tokens, check_sequences,
                                     check_stop_and_bad_words)
from vx.serve.state import ServerState, new_id
from vx.serve.streaming import ClientDisconnected, EventStreamResponse, run_until_disconnect
from vx.serve.tool_grammar import auto_tool_constraint
from vx.serve.tool_parser import (ParsedToolCall, ToolCallStreamBuffer, forced_call_texts, forced_tool_calls,
                                  forced_tool_schema, new_call_id, parse_tool_calls)
from vx.serve.validation import check_json_schema, check_json_text

ENDPOINT = "/v1/chat/completions"


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, receive: Receive) -> Response:
    """Validate `req`, run it, and answer in OpenAI's chat shape (a 4xx `APIError` for bad input)."""
    start = now()
    with state.metrics.errors_counted(ENDPOINT):
        return await _create(state, req, receive, start)


def _tool_choice(req: ChatCompletionRequest) -> str | NamedToolChoice:
    if req.tools is not None and not req.tools:  # OpenAI's words: an empty list is not "no tools"
        raise bad_request("[] is too short - 'tools'", "tools")
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
    if choice != "none" and not req.tools and (choice == "required" or isinstance(choice, NamedToolChoice)):
        raise bad_request("tool_choice needs tools: none were given.", "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in req.tools or []}:
        raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not among the tools.",
                          "tool_choice")
    return choice


def _tools_constraint(req: ChatCompletionRequest,
                      tool_choice: str | NamedToolChoice) -> tuple[StructuredOutputsParams | None, str]:
    """The constraint the tools put on the reply, and the field to name if it is refused: a forced call's schema
    ("required", a named function), or for "auto" the union of content (fitting `response_format`) and calls
    (fitting the parameters of `strict` tools), unless the request brings a constraint of its own. One larger than
    `StructuredOutputsParams` allows is a 400 naming that field."""
    param = _tools_param(req, tool_choice)
    try:
        return _tools_schema(req, tool_choice), param
    except ValueError as e:
        raise constraint_error(str(e), param) or bad_request(f"{param}: {e}", param) from None


def _tools_param(req: ChatCompletionRequest, tool_choice: str | NamedToolChoice) -> str:
    """The request field the tools' constraint comes from: the forced tool's parameters, or `tools`, or for
    "auto" with a response format and no strict tool, `response_format`."""
    tools = req.tools or []
    if isinstance(tool_choice, NamedToolChoice):
        return f"tools.{[t.function.name for t in tools].index(tool_choice.function.name)}.function.parameters"
    if tool_choice == "required":
        return "tools.0.function.parameters" if len(tools) == 1 else "tools"
    strict = any(t.function.strict for t in tools)
    has_format = req.response_format is not None and req.response_format.type != "text"
    return "response_format" if has_format and not strict else "tools"


def _tools_schema(req: ChatCompletionRequest, tool_choice: str | NamedToolChoice) -> StructuredOutputsParams | None:
    tools = req.tools or []
    parallel = req.parallel_tool_calls is not False
    if isinstance(tool_choice, NamedToolChoice) or (tool_choice == "required" and tools):
        return forced_tool_schema(tools, tool_choice, parallel)
    explicit = req.structured_outputs is not None or any(
        v is not None for v in (req.guided_json, req.guided_regex, req.guided_choice, req.guided_grammar))
    if tool_choice != "auto" or not tools or explicit:
        return None
    return auto_tool_constraint(tools, req.response_format, parallel)


def _check_json_fields(req: ChatCompletionRequest, max_depth: int) -> None:
    """The tools' parameter schemas must be valid JSON schemas, and the arguments of earlier calls (JSON text
    inside a message) no deeper than the body may nest."""
    for i, tool in enumerate(req.tools or []):
        if tool.function.parameters is not None:
            check_json_schema(tool.function.parameters, f"tools.{i}.function.parameters")
    for i, message in enumerate(req.messages):
        calls = message.get("tool_calls")
        for j, call in enumerate(calls if isinstance(calls, list) else []):
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(arguments, str):
                check_json_text(arguments, max_depth, f"messages[{i}].tool_calls[{j}].function.arguments",
                                f"messages.{i}.tool_calls")


async def _create(state: ServerState, req: ChatCompletionRequest, receive: Receive, start: float) -> Response:
    model = state.model_name(req.model)
    check_request_shape(req)
    check_sequences(1, req.n, state.options, state.max_n_sequences)
    check_stop_and_bad_words(req, state.options)
    tool_choice = _tool_choice(req)
    _check_json_fields(req, state.options.max_json_depth)
    tools_constraint, tools_param = _tools_constraint(req, tool_choice)
    auto_union = tools_constraint is not None and tool_choice == "auto"  # holds the response format too
    constraint = output_constraint(req, None if auto_union else req.response_format, tools_constraint, tools_param,
                                   max_json_depth=state.options.max_json_depth)
    constraint_param, structured = constraint if constraint is not None else (None, None)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true.", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be between 0 and {MAX_LOGPROBS}.", "top_logprobs")
    top_n = (req.top_logprobs or 0) if req.logprobs else 0
    if req.chat_template and not state.trust_request_chat_template:
        raise bad_request("This server does not accept a chat_template in the request: start it with "
                          "--trust-request-chat-template to allow that.", "chat_template")
    chat_template = req.chat_template or state.chat_template
    prompt_ids = await chat_prompt_ids(state.templates, state.tokenizer, req.messages,
                                       tools=req.tools if tool_choice != "none" else None,
                                       chat_template=chat_template, trusted=not req.chat_template,
                                       add_generation_prompt=req.add_generation_prompt,
                                       max_model_len=state.max_model_len, tokenize_limiter=state.tokenize_limiter,
                                       template_kwargs=req.chat_template_kwargs)
    max_tokens, max_param = ((req.max_completion_tokens, "max_completion_tokens")
                             if req.max_completion_tokens is not None else (req.max_tokens, "max_tokens"))
    check_context_length(len(prompt_ids), max_tokens, state.max_model_len, param=max_param, prompt_name="messages")
    check_request_tokens([len(prompt_ids)], req.n, max_tokens, state.max_model_len, state.options,
                         max_tokens_param=max_param)
    check_logprob_entries([len(prompt_ids)], req.n, max_tokens, state.max_model_len, state.options,
                          logprobs=top_n if req.logprobs else None, echo=False,
                          param="top_logprobs" if req.top_logprobs else "logprobs")
    try:
        params = sampling_params(req, max_tokens=max_tokens, logprobs=top_n if req.logprobs else None,
                                 structured=structured)
    except APIError as e:
        if e.param == "max_tokens":  # the field the client set
            e.param = max_param
        raise
    try:  # stop at the end-of-turn token too
        params = chat_sampling_params(params, state.tokenizer, chat_template)
    except ValueError as e:  # the client's stop_token_ids leave no room for the template's
        raise bad_request(str(e), "stop_token_ids") from None
    rid, created = new_id("chatcmpl"), int(time.time())
    job = make_jobs([prompt_ids], params, rid, state.metrics, ENDPOINT, start, constraint_param)[0]
    reader = _ReplyReader(req, tool_choice, state.tokenizer, top_n,
                          _reasoning(state, req, tool_choice, prompt_ids, structured))

    if not req.stream:
        try:
            await run_until_disconnect(receive, lambda: run_jobs(state.llm, [job]))
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; the request was aborted
        choices = [reader.final_choice(c) for c in job.choices]
        job.report([c.finish_reason or "abort" for c in choices])
        resp = ChatCompletionResponse(id=rid, created=created, model=model, choices=choices, usage=_usage(job))
        return Response(resp.model_dump_json(), media_type="application/json")

    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return ChatCompletionChunk(id=rid, created=created, model=model, choices=choices,
                                   usage=usage).model_dump_json()

    async def produce(emit: Any) -> None:
        final_reasons: dict[int, str] = {}

        async def on_delta(job: EngineJob, out: RequestOutput) -> None:
            for c in out.outputs:
                for choice in reader.delta_choices(job.choices[c.index], c):
                    if choice.finish_reason is not None:
                        final_reasons[choice.index] = choice.finish_reason
                    await emit(chunk([choice]))

        with state.metrics.errors_counted(ENDPOINT):
            await run_jobs(state.llm, [job], on_delta)
        job.report([final_reasons.get(c.index, c.finish_reason or "abort") for c in job.choices])
        if req.stream_options is not None and req.stream_options.include_usage:
            await emit(chunk([], _usage(job)))

    return EventStreamResponse(produce)


class _ReplyReader:
    """Turns a choice's generated text into OpenAI's message: content, tool calls, logprobs, finish reason."""

    def __init__(self, req: ChatCompletionRequest, tool_choice: str | NamedToolChoice, tokenizer: Any,
                 top_n: int, reasoning: Callable[[], ReasoningSplitter] | None = None) -> None:
        self.req = req
        self.tool_choice = tool_choice
        self.forced = req.tools is not None and (tool_choice == "required" or isinstance(tool_choice, NamedToolChoice))
        self.tool_names = {t.function.name for t in req.tools or []}
        self.tokenizer = tokenizer
        self.top_n = top_n
        self.buffers: dict[int, ToolCallStreamBuffer] = {}  # "auto" streaming: per choice
        self.opened: set[int] = set()  # choices whose role went out
        self.reasoning = reasoning  # a new splitter per choice, when the reply is read for a think block
        self.splitters: dict[int, ReasoningSplitter] = {}  # streaming: per choice
        self.streamed: dict[int, list[list[Any]]] = {}  # forced streaming: per choice, [id, arguments sent] a call

    def _calls(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        if self.forced:  # the whole reply is the call, complete or cut short: never content
            return None, forced_tool_calls(text, self.tool_choice, list(self.tool_names))
        if self.tool_choice == "auto":
            return parse_tool_calls(text, self.tool_names)
        return text, []

    def _limit(self, calls: list[ParsedToolCall]) -> list[ParsedToolCall]:
        return calls[:1] if self.req.parallel_tool_calls is False else calls

    def _logprobs(self, token_ids: list[int], positions: Any) -> ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        return ChatLogprobs(content=chat_logprobs(self.tokenizer, token_ids, positions, self.top_n))

    def final_choice(self, c: Choice) -> ChatChoice:
        reasoning, text = self.reasoning().split(c.text) if self.reasoning is not None else (None, c.text)
        content, calls = self._calls(text) if text is not None else (None, [])
        calls = self._limit(calls)
        tool_calls = [ToolCall(id=k.id, function=FunctionCall(name=k.name, arguments=k.arguments)) for k in calls]
        return ChatChoice(index=c.index, message=ChatMessage(content=content, reasoning_content=reasoning,
                                                             tool_calls=tool_calls or None),
                          logprobs=self._logprobs(c.token_ids, c.logprobs),
                          finish_reason=_finish_reason(bool(calls), c.finish_reason), stop_reason=c.stop_reason)

    def delta_choices(self, acc: Choice, delta: CompletionOutput) -> list[ChatStreamChoice]:
        """The chunks for one delta of one choice (`acc` already holds it): the role first, then content,
        and at the end the tool calls and the finish reason. With tools, the role waits for the first content
        or call, so that a reply that is a call opens with `content: null`, as OpenAI's does."""
        out = []
        if acc.index not in self.buffers:
            self.buffers[acc.index] = ToolCallStreamBuffer(self.tool_names)
            if self.tool_choice == "none":
                out.append(ChatStreamChoice(index=acc.index, delta=DeltaMessage(role="assistant", content="")))
                self.opened.add(acc.index)
        buffer = self.buffers[acc.index]
        thought, text = self._think(acc.index, delta)
        forced_calls = self._forced_deltas(acc, delta.finish_reason is not None) if self.forced else []
        if self.forced:
            text = ""  # the whole reply is the call: it streams as the call's arguments
        elif self.tool_choice == "auto":
            text = buffer.feed(text)
        calls: list[ParsedToolCall] = []
        if delta.finish_reason is not None and self.tool_choice == "auto":
            rest, calls = buffer.finish()
            text, calls = text + rest, self._limit(calls)
        logprobs = self._logprobs(delta.token_ids, delta.logprobs) if delta.token_ids else None
        if thought:
            out.append(ChatStreamChoice(index=acc.index, delta=self._open(acc.index, DeltaMessage(
                reasoning_content=thought))))
        if text or logprobs is not None:
            out.append(ChatStreamChoice(index=acc.index, delta=self._open(acc.index, DeltaMessage(
                content=None if self.forced else text)),  # (a forced reply's logprobs come with no content)
                                        logprobs=logprobs))
        tool_deltas = forced_calls or [DeltaToolCall(index=i, id=k.id, type="function", function=DeltaFunctionCall(
            name=k.name, arguments=k.arguments)) for i, k in enumerate(calls)]
        if tool_deltas:
            out.append(ChatStreamChoice(index=acc.index, delta=self._open(acc.index, DeltaMessage(
                tool_calls=tool_deltas))))
        if delta.finish_reason is not None:
            made_calls = bool(calls or self.streamed.get(acc.index))
            out.append(ChatStreamChoice(index=acc.index, delta=self._open(acc.index, DeltaMessage()),
                                        finish_reason=_finish_reason(made_calls, delta.finish_reason),
                                        stop_reason=delta.stop_reason))
        return out

    def _forced_deltas(self, acc: Choice, finished: bool) -> list[DeltaToolCall]:
        """A forced call streams as OpenAI's do: a call's id and name once its name is complete, then its
        arguments text as it is written (the name of a call cut short goes out at the end)."""
        texts = forced_call_texts(acc.text, self.tool_choice, sorted(self.tool_names))
        sent = self.streamed.setdefault(acc.index, [])  # per call: its id and how much of its arguments went out
        out = []
        for i, call in enumerate(texts[:1] if self.req.parallel_tool_calls is False else texts):
            piece = call.arguments[sent[i][1]:] if i < len(sent) else call.arguments
            if i == len(sent):
                if not (call.name_complete or finished):
                    break
                sent.append([new_call_id(), 0])
                out.append(DeltaToolCall(index=i, id=sent[i][0], type="function",
                                         function=DeltaFunctionCall(name=call.name, arguments=piece)))
            elif piece:
                out.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=piece)))
            sent[i][1] = max(sent[i][1], len(call.arguments))
        return out

    def _think(self, index: int, delta: CompletionOutput) -> tuple[str, str]:
        """The (reasoning, content) of one delta; all content when the reply is not read for a think block."""
        if self.reasoning is None:
            return "", delta.text
        splitter = self.splitters.setdefault(index, self.reasoning())
        thought, text = splitter.feed(delta.text)
        if delta.finish_reason is not None:
            more_thought, more_text = splitter.finish()
            thought, text = thought + more_thought, text + more_text
        return thought, text

    def _open(self, index: int, delta: DeltaMessage) -> DeltaMessage:
        """`delta`, carrying the role if it is the choice's first."""
        if index not in self.opened:
            self.opened.add(index)
            delta.role = "assistant"
        return delta


def _reasoning(state: ServerState, req: ChatCompletionRequest, tool_choice: str | NamedToolChoice,
               prompt_ids: list[int], structured: StructuredOutputsParams | None
               ) -> Callable[[], ReasoningSplitter] | None:
    """The splitter factory for this request's replies, if they are read for a think block: a reasoning parser is
    set, the request did not turn thinking off, and the reply is not a forced call (constrained from its start).
    JSON and choice constraints hold the reply from its first token; a regex or grammar may write the block."""
    parser = state.options.reasoning_parser
    if parser is None or not reasoning_enabled(parser, req.chat_template_kwargs) or \
            tool_choice == "required" or isinstance(tool_choice, NamedToolChoice):
        return None
    opened = state.tokenizer.decode(prompt_ids[-8:]).rstrip().endswith(THINK_OPEN)  # the template opened it
    constrained = structured is not None and structured.kind not in ("regex", "grammar")
    return partial(ReasoningSplitter, starts_inside(parser, opened, constrained))


def _finish_reason(made_calls: bool, finish_reason: str | None) -> str | None:
    """"tool_calls" for a reply that made calls, unless max_tokens cut it ("length", as OpenAI says then)."""
    return "tool_calls" if made_calls and finish_reason != "length" else finish_reason


def _usage(job: EngineJob) -> UsageInfo:
    prompt, completion = len(job.prompt_ids), job.num_generated
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
