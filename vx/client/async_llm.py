"""`vx.AsyncLLM`: streaming generation for async applications, on asyncio or trio (through anyio).

The engine runs in a background process (`AsyncMPClient`). In this process, one output task reads engine
outputs, detokenizes them (`OutputProcessor`) and hands each to its request's `RequestStream` without ever
waiting for a consumer; a second task watches the engine process so that its death is noticed at once.
Leaving an `async for` early, in any way, aborts the request in the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import uuid
import weakref
from typing import Any, AsyncGenerator, Sequence

import anyio
import anyio.abc

from vx.client.core_client import AsyncMPClient
from vx.client.request_stream import RequestStream
from vx.client.submit import Prompt, PromptRequest, is_single_prompt, normalize_prompts, submit_requests
from vx.config import EngineArgs, VxConfig
from vx.core.protocol import EngineCoreOutputs, EngineCoreRequest
from vx.errors import EngineDeadError, EngineGenerateError
from vx.outputs import EmbeddingRequestOutput, EngineStats, RequestOutput
from vx.pooling_params import PoolingParams
from vx.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    """Async streaming front end: `async with vx.AsyncLLM(model, **engine_args) as llm: ...`.

    The constructor only validates the arguments; entering the context starts the engine process without
    blocking the event loop, and leaving it shuts the engine down. Use it from one event loop (thread).
    The engine process starts as its own module (`vx.core.engine_main`) and never re-imports the application's
    main module: a script needs no `if __name__ == "__main__":` guard.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine_args = EngineArgs.from_kwargs(model, **engine_args)
        self.engine_args.validate()
        self.config: VxConfig | None = None  # resolved when the engine starts (in `async with`)
        self.tokenizer: Any = None
        self._client: AsyncMPClient | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self._background: list[tuple[anyio.CancelScope, anyio.Event]] = []  # the output and watcher tasks
        self._loop_thread: int | None = None
        self._closed = False

    # --------------------------------------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> "AsyncLLM":
        if self._client is not None or self._closed:
            raise RuntimeError("This AsyncLLM was already started; create a new one.")
        try:
            await anyio.to_thread.run_sync(self._start_blocking)
        except BaseException:
            # Cancellation waits for the thread, so a started engine must not be left behind.
            with anyio.CancelScope(shield=True):
                await self._close_client()
            raise
        self._loop_thread = threading.get_ident()
        # The task group lives in the caller's task from here to __aexit__, so it must be exited there, in
        # order. `shutdown()` may run anywhere (any nesting of cancel scopes): it stops the background tasks
        # through their own scopes, and the group is left empty for __aexit__ to close.
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        for fn in (self._output_loop, self._client.watch_engine):
            scope, done = anyio.CancelScope(), anyio.Event()
            self._background.append((scope, done))
            self._task_group.start_soon(_run_in_scope, fn, scope, done, name=f"vx-{fn.__name__}")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            await self.shutdown()
        finally:
            if self._task_group is not None:
                tg, self._task_group = self._task_group, None
                await tg.__aexit__(None, None, None)  # empty by now

    def _start_blocking(self) -> None:
        from vx.client.output_processor import OutputProcessor
        from vx.client.processor import Processor
        from vx.client.tokenizer import load_tokenizer

        from vx.config.model_source import resolve_model

        # Convert a GGUF model first (once), so that the engine finds it ready. The config is resolved here (from
        # config.json as plain JSON: transformers would import torch) and goes to the engine whole; the tokenizer
        # loads while the engine boots (importing torch, loading weights).
        model_path = resolve_model(self.engine_args.model)
        config = dataclasses.replace(self.engine_args, model=model_path).create_config(light=True)
        client = AsyncMPClient(config, wait=False)
        try:
            self.tokenizer = load_tokenizer(config.model_config.tokenizer)
            client.engine.wait_ready()
            self.config = config
            self.processor = Processor(config.model_config, self.tokenizer,
                                       config.scheduler_config.max_n_sequences)
            self.output_processor = OutputProcessor(self.tokenizer)
        except BaseException:
            client.shutdown()
            raise
        self._client = client

    async def shutdown(self) -> None:
        """Stop the engine (gracefully, then by force), fail whatever still streams, release every resource."""
        if self._closed or self._client is None:
            self._closed = True
            return
        self._closed = True
        self._client.engine.closing = True
        self._fail_all(EngineDeadError("The AsyncLLM was shut down."))
        with anyio.CancelScope(shield=True):  # even under cancellation, never leave the process behind
            for scope, _ in self._background:
                scope.cancel()
            for _, done in self._background:
                await done.wait()  # no task may touch the sockets once they close
            await self._close_client()

    async def _close_client(self) -> None:
        if self._client is not None:
            await anyio.to_thread.run_sync(self._client.shutdown)

    # ------------------------------------------------------------------------------------------------ public
    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0) -> AsyncGenerator[RequestOutput, None]:
        """Stream `RequestOutput`s of one request, shaped by `params.output_kind` (CUMULATIVE, DELTA, FINAL_ONLY).

        With `n > 1` each output holds the samples (`CompletionOutput.index`) that have news (DELTA) or all of them.
        `priority` matters with `scheduling_policy="priority"` (lower runs first). Bad input raises `ValueError`;
        a dead engine raises `vx.EngineDeadError`. Leaving the loop early aborts.
        """
        stream = self._add_request(prompt, params, request_id, priority)
        finished = False
        try:
            while not finished:
                output = await stream.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self._abort_now(stream)

    async def stream(self, prompt: Prompt, params: SamplingParams | None = None,
                     request_id: str | None = None, *, priority: int = 0) -> AsyncGenerator[str, None]:
        """Stream the generated text as deltas (`params.output_kind` is ignored; `n` must be 1: use `generate`)."""
        params = _with_output_kind(params, RequestOutputKind.DELTA)
        if params.n != 1:
            raise ValueError(f"stream() yields one text, but n={params.n}; use generate() for parallel samples.")
        # aclosing: leaving this loop early must close (and so abort) the request now, not at garbage collection.
        async with contextlib.aclosing(self.generate(prompt, params, request_id, priority=priority)) as outputs:
            async for output in outputs:
                text = output.outputs[0].text if output.outputs else ""
                if text:
                    yield text

    async def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None, *,
                   tools: list[dict[str, Any]] | None = None, chat_template: str | None = None,
                   request_id: str | None = None, priority: int = 0) -> AsyncGenerator[str, None]:
        """Stream the assistant's reply to `messages` (OpenAI-style dicts) as text deltas.

        The model's chat template renders the conversation (with `tools`, if given); the reply stops at the
        template's end-of-turn token. Without `params`, a chat default applies (`max_tokens=512`, T=0.7).
        """
        from vx.client.chat import chat_sampling_params, render_chat_prompt

        self._require_client()
        text = render_chat_prompt(self.tokenizer, messages, tools=tools, chat_template=chat_template)
        # The template already holds the special tokens (bos etc.): tokenize without adding them again.
        prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        params = chat_sampling_params(params, self.tokenizer, chat_template)
        async for delta in self.stream(prompt_ids, params, request_id, priority=priority):
            yield delta

    async def complete(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0) -> RequestOutput:
        """Run one request to its end and return the final output (cumulative text and token ids)."""
        stream = self._add_request(prompt, _with_output_kind(params, RequestOutputKind.FINAL_ONLY), request_id,
                                   priority)
        return (await self._final_outputs([stream]))[0]

    async def embed(self, prompt: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None,
                    request_id: str | None = None, *, priority: int = 0,
                    ) -> EmbeddingRequestOutput | list[EmbeddingRequestOutput]:
        """The embedding of one prompt (a str or a list of token ids), or a list of them for a list of prompts
        (run concurrently; `request_id`, if given, gets `-i` appended for prompt i), as vLLM's `LLM.embed`.

        The prompt runs through the same scheduler and KV cache as generation and ends after its prompt. Default
        pooling: the last token's final hidden state, L2-normalised; see `vx.PoolingParams`. Bad input raises
        `ValueError` before anything runs.
        """
        params = PoolingParams() if pooling_params is None else pooling_params
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a vx.PoolingParams or None, got {type(params).__name__}.")
        single = is_single_prompt(prompt)
        prompts = normalize_prompts(prompt)
        ids = [uuid.uuid4().hex if request_id is None else request_id if single else f"{request_id}-{i}"
               for i in range(len(prompts))]
        streams = self._add_requests([PromptRequest(rid, p, params, priority=priority) for rid, p in zip(ids, prompts)])
        outputs = await self._final_outputs(streams)
        return outputs[0] if single else outputs

    async def abort(self, request_id: str) -> None:
        """Abort a request: the engine frees it, and its stream ends with a final output (finish_reason 'abort')."""
        client = self._require_client()
        client.abort_requests(self.output_processor.engine_request_ids([request_id]))
        stream = self.output_processor.queue_of(request_id)
        finals = self.output_processor.abort_requests([request_id])
        if stream is not None:
            for output in finals:
                stream.put(output)
            if not finals:
                stream.fail(EngineGenerateError(f"Request {request_id!r} was aborted."))

    async def stats(self) -> EngineStats:
        """A snapshot of the engine: queues, KV blocks, prefix-cache hits, preemptions, steps."""
        client = self._require_client()
        self.output_processor.do_deferred_drops()  # so that the front end's state is as current as the engine's
        return await client.stats_async()

    @property
    def num_unfinished_requests(self) -> int:
        """Requests this front end still tracks (0 once every request has ended)."""
        return self.output_processor.get_num_unfinished_requests() if self._client is not None else 0

    @property
    def errored(self) -> bool:
        """True once the engine died on its own (crashed, was killed), as vLLM's `AsyncLLM.errored`; False while
        it runs and after a normal shutdown. Every call then raises `dead_error`."""
        return self._client is not None and self._client.engine.crashed

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine died (a fresh `vx.EngineDeadError`, with the engine's error as `__cause__`) once
        `errored`, else None."""
        return self._client.dead_error() if self._client is not None and self.errored else None

    # ------------------------------------------------------------------------------------------- internals
    def _require_client(self) -> AsyncMPClient:
        if self._client is None or self._closed:
            if self._closed:
                raise EngineDeadError("The AsyncLLM was shut down.")
            raise RuntimeError("Start the engine first: `async with vx.AsyncLLM(...) as llm:`.")
        self._client.engine.raise_if_dead()
        return self._client

    def _add_request(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None,
                     priority: int = 0) -> RequestStream:
        rid = uuid.uuid4().hex if request_id is None else request_id
        return self._add_requests([PromptRequest(rid, prompt, params, priority=priority)])[0]

    def _add_requests(self, requests: list[PromptRequest]) -> list[RequestStream]:
        """Submit `requests` all or nothing; a stream for each, in order."""
        client = self._require_client()
        streams: list[RequestStream] = []

        def new_stream(request: EngineCoreRequest) -> RequestStream:
            streams.append(RequestStream(request.request_id, request.sampling_params.output_kind))
            return streams[-1]

        submit_requests(self.processor, self.output_processor, client, requests, new_stream)
        # Armed after the send, when the streams are surely registered: no output can be handled in between (the
        # output task runs on this thread, and nothing here awaits), and the stream of a failed submission, whose
        # id may name another running request, never aborts anything.
        for stream in streams:
            stream.finalizer = weakref.finalize(stream, _abort_lost_stream, weakref.ref(self), stream.request_id)
        return streams

    async def _final_outputs(self, streams: list[RequestStream]) -> list[Any]:
        """Each stream's final output, in order; any error (cancellation too) aborts every request not yet done."""
        outputs = []
        try:
            for stream in streams:
                while True:
                    output = await stream.get()
                    if output.finished:
                        outputs.append(output)
                        break
        except BaseException:
            for stream in streams:
                self._abort_now(stream)
            raise
        return outputs

    def _abort_now(self, stream: RequestStream) -> None:
        """Synchronous abort (works under cancellation and in finalizers): tell the engine, drop our state.

        Only while `stream` is still its request's queue: once the request ended (or failed, or was aborted) there
        is nothing to abort, and its id may already name a new request.
        """
        rid = stream.request_id
        if self._client is None or self.output_processor.queue_of(rid) is not stream:
            return
        stream.detach()
        self._client.abort_requests(self.output_processor.engine_request_ids([rid]))
        self.output_processor.drop(rid, stream, now=threading.get_ident() == self._loop_thread)

    def _abort_from_finalizer(self, request_id: str) -> None:
        # A finalizer may run in any thread, or while the loop's thread walks the request table: only the
        # (thread-safe) engine abort happens now; the output processor drops the state when it safely can.
        if self._client is not None:
            self._client.abort_requests(self.output_processor.engine_request_ids([request_id]))
            self.output_processor.drop(request_id, None, now=False)

    async def _output_loop(self) -> None:
        """Demultiplex engine outputs into the request streams. Never raises (but for cancellation)."""
        client = self._client
        assert client is not None
        try:
            while True:
                self._process(await client.get_output_async())
        except EngineDeadError as e:
            self._fail_all(e)
        except Exception as e:  # noqa: BLE001 - a bug here must fail the requests, not the application's task
            logger.exception("vx AsyncLLM output task failed")
            client.engine.mark_dead(f"The vx AsyncLLM output task failed: {type(e).__name__}: {e}")
            self._fail_all(client.dead_error() or EngineDeadError())

    def _process(self, outs: EngineCoreOutputs) -> None:
        """Fail the requests the engine refused, and hand the outputs to their streams (the output processor does)."""
        for err in outs.input_errors:
            rid = self.output_processor.request_id_of(err.request_id) if err.request_id is not None else None
            stream = self.output_processor.queue_of(rid) if rid is not None else None
            if stream is None:
                logger.warning("The vx engine refused an input message: %s", err.message)
                continue
            _, others = self.output_processor.drop_failed(err.request_id)
            if others:  # the other samples of an n > 1 request
                self._client.abort_requests(others)
            stream.fail(err.to_exception(stream.request_id))
        if not outs.outputs:
            return
        processed = self.output_processor.process_outputs(outs.outputs)
        if processed.reqs_to_abort:  # finished here by a stop string; the engine still runs them
            assert self._client is not None
            self._client.abort_requests(processed.reqs_to_abort)

    def _fail_all(self, error: EngineDeadError) -> None:
        """The engine is gone: every stream raises a copy of `error`, and no front-end state is kept."""
        if self._client is None:
            return
        op = self.output_processor
        streams = op.queues()
        op.abort_requests(op.request_ids())
        for stream in streams:
            copy = EngineDeadError(str(error))
            copy.__cause__ = error.__cause__
            stream.fail(copy)


def _with_output_kind(params: SamplingParams | None, kind: RequestOutputKind) -> SamplingParams:
    """A copy of `params` (default: `SamplingParams()`) with `output_kind` set; `ValueError` for a non-params."""
    if params is None:
        return SamplingParams(output_kind=kind)
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a vx.SamplingParams or None, got {type(params).__name__}.")
    return params.clone(output_kind=kind)


async def _run_in_scope(fn: Any, scope: anyio.CancelScope, done: anyio.Event) -> None:
    try:
        with scope:
            await fn()
    finally:
        done.set()


def _abort_lost_stream(llm_ref: "weakref.ReferenceType[AsyncLLM]", request_id: str) -> None:
    """A stream was garbage-collected while its request ran (its generator dropped unclosed): abort it."""
    llm = llm_ref()
    if llm is not None and not llm._closed:
        llm._abort_from_finalizer(request_id)
