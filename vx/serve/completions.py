"""`POST /v1/completions`: text completion of one prompt or a batch, streamed as SSE or returned whole."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from starlette.responses import Response
from starlette.types import Receive

from vx.outputs import RequestOutput
from vx.serve.errors import bad_request
from vx.serve.generation import EngineJob, make_jobs, now, run_jobs
from vx.serve.logprobs import append_completion_logprobs
from vx.serve.params import check_context_length, check_request_shape, output_constraint, sampling_params
from vx.serve.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                               UsageInfo)
from vx.serve.request_limits import (check_logprob_entries, check_prompt_count, check_request_tokens,
                                     check_sequences, check_stop_and_bad_words, prompt_count)
from vx.serve.state import ServerState, new_id
from vx.serve.streaming import ClientDisconnected, EventStreamResponse, run_until_disconnect
from vx.serve.prompt_tokens import in_thread, tokenize_prompts

ENDPOINT = "/v1/completions"


async def create_completion(state: ServerState, req: CompletionRequest, receive: Receive) -> Response:
    """Validate `req`, run it, and answer in OpenAI's completion shape (a 4xx `APIError` for bad input)."""
    start = now()
    with state.metrics.errors_counted(ENDPOINT):
        return await _create(state, req, receive, start)


async def _create(state: ServerState, req: CompletionRequest, receive: Receive, start: float) -> Response:
    model = state.model_name(req.model)
    check_request_shape(req)
    if req.suffix:
        raise bad_request("suffix is not supported.", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported (only best_of == n).", "best_of")
    options = state.options
    num_prompts = prompt_count(req.prompt)
    check_prompt_count(num_prompts, options)
    check_sequences(num_prompts, req.n, options, state.max_n_sequences)
    check_stop_and_bad_words(req, options)
    texts, prompts = await in_thread(partial(tokenize_prompts, req.prompt, state.tokenizer, state.max_model_len),
                                     state.tokenize_limiter)
    check_context_length(max(len(p) for p in prompts), req.max_tokens, state.max_model_len, param="max_tokens",
                         prompt_name="prompt")
    lengths = [len(p) for p in prompts]
    check_request_tokens(lengths, req.n, req.max_tokens, state.max_model_len, options, max_tokens_param="max_tokens")
    check_logprob_entries(lengths, req.n, req.max_tokens, state.max_model_len, options, logprobs=req.logprobs,
                          echo=req.echo, param="logprobs")
    constraint = output_constraint(req, req.response_format, None, max_json_depth=state.options.max_json_depth)
    constraint_param, structured = constraint if constraint is not None else (None, None)
    params = sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs, structured=structured,
                             prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None)
    rid, created = new_id("cmpl"), int(time.time())
    jobs = make_jobs(prompts, params, rid, state.metrics, ENDPOINT, start, constraint_param)
    view = _View(state.tokenizer, req, texts, jobs)

    if not req.stream:
        try:
            await run_until_disconnect(receive, lambda: run_jobs(state.llm, jobs))
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; the requests were aborted
        for job in jobs:
            job.report()
        resp = CompletionResponse(id=rid, created=created, model=model, choices=view.final_choices(),
                                  usage=_usage(jobs))
        return Response(resp.model_dump_json(), media_type="application/json")

    async def produce(emit: Any) -> None:
        async def on_delta(job: EngineJob, out: RequestOutput) -> None:
            for c in out.outputs:
                choice = view.delta_choice(job, c.index, c.text, c.token_ids, c.logprobs, c.finish_reason,
                                           c.stop_reason)
                if choice is not None:
                    chunk = CompletionResponse(id=rid, created=created, model=model, choices=[choice])
                    await emit(chunk.model_dump_json())

        with state.metrics.errors_counted(ENDPOINT):
            await run_jobs(state.llm, jobs, on_delta)
        for job in jobs:
            job.report()
        if req.stream_options is not None and req.stream_options.include_usage:
            await emit(CompletionResponse(id=rid, created=created, model=model, choices=[],
                                          usage=_usage(jobs)).model_dump_json())

    return EventStreamResponse(produce)


class _View:
    """Shapes the jobs' choices as OpenAI completion choices: echo, logprobs with text offsets."""

    def __init__(self, tokenizer: Any, req: CompletionRequest, texts: list[str | None], jobs: list[EngineJob]):
        self.tokenizer = tokenizer
        self.req = req
        self.texts = texts
        self.jobs = jobs
        self.offsets: dict[int, int] = {}  # choice index -> text offset of its next token
        self.started: set[int] = set()  # choice indices that sent their first chunk

    def _echo(self, job: EngineJob) -> str:
        i = self.jobs.index(job)
        text = self.texts[i]
        return text if text is not None else self.tokenizer.decode(job.prompt_ids)

    def _head(self, job: EngineJob, index: int, lp: CompletionLogprobs | None) -> str:
        """The echoed prompt (and its logprobs) that opens choice `index`, if echo is on."""
        self.offsets[index] = 0
        if not self.req.echo:
            return ""
        echo = self._echo(job)
        if lp is not None:
            append_completion_logprobs(lp, self.tokenizer, job.prompt_ids, job.prompt_logprobs, 0)
        self.offsets[index] = len(echo)
        return echo

    def delta_choice(self, job: EngineJob, seq: int, text: str, token_ids: list[int], logprobs: Any,
                     finish_reason: str | None, stop_reason: Any) -> CompletionChoice | None:
        index = job.first_index + seq
        lp = CompletionLogprobs() if self.req.logprobs is not None else None
        head = ""
        if index not in self.started:
            self.started.add(index)
            head = self._head(job, index, lp)
        if lp is not None:
            self.offsets[index] = append_completion_logprobs(lp, self.tokenizer, token_ids, logprobs,
                                                             self.offsets[index])
        if not (head or text or finish_reason or (lp is not None and lp.tokens)):
            return None
        return CompletionChoice(index=index, text=head + text, logprobs=lp, finish_reason=finish_reason,
                                stop_reason=stop_reason)

    def final_choices(self) -> list[CompletionChoice]:
        out = []
        for job in self.jobs:
            for c in job.choices:
                lp = CompletionLogprobs() if self.req.logprobs is not None else None
                head = self._head(job, c.index, lp)
                if lp is not None:
                    append_completion_logprobs(lp, self.tokenizer, c.token_ids, c.logprobs, self.offsets[c.index])
                out.append(CompletionChoice(index=c.index, text=head + c.text, logprobs=lp,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return out


def _usage(jobs: list[EngineJob]) -> UsageInfo:
    prompt = sum(len(j.prompt_ids) for j in jobs)
    completion = sum(j.num_generated for j in jobs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
