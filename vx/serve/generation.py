"""Running engine requests for an HTTP request: deltas out, choices assembled, metrics kept, errors mapped.

Every request runs in DELTA mode, streaming or not, so that time to first token and inter-token latency are
measured the same way for both and no output is copied twice. A completions request with several prompts
runs them concurrently, as one engine request each.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import anyio

from vx.errors import EngineDeadError, EngineGenerateError, EngineOverloadedError, InvalidRequestError
from vx.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from vx.sampling_params import SamplingParams
from vx.serve.errors import APIError, bad_request, unexpected_error
from vx.serve.metrics import RequestTimer, ServerMetrics

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

OnDelta = Callable[["EngineJob", RequestOutput], Awaitable[None]]


@dataclass
class Choice:
    """One choice of a response, accumulated from its deltas."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    _parts: list[str] = field(default_factory=list)  # text deltas, joined on demand (no quadratic +=)

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def add(self, delta: CompletionOutput) -> None:
        if delta.text:
            self._parts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass
class EngineJob:
    """One engine request: a prompt's token ids, its `n` choices (numbered from `first_index` in the
    response), and its timing."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    first_index: int
    timer: RequestTimer
    choices: list[Choice] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finished: bool = False
    constraint_param: str | None = None  # the request field the output constraint came from, for its errors

    def __post_init__(self) -> None:
        self.choices = [Choice(self.first_index + i) for i in range(self.params.n)]

    async def run(self, llm: Any, on_delta: OnDelta | None = None) -> None:
        """Stream the request through the engine, accumulating its choices; `on_delta(job, out)` sees each
        output after it was added. Cancellation aborts the request in the engine."""
        first = True
        try:
            async for out in llm.generate(self.prompt_ids, self.params, self.request_id):
                if first:  # accepted by the engine: its prompt counts
                    first = False
                    self.timer.prompt(len(self.prompt_ids))
                    self.prompt_logprobs = out.prompt_logprobs
                lengths = [len(c.token_ids) for c in out.outputs]
                self.timer.tokens(sum(lengths), max(lengths, default=0))
                for c in out.outputs:
                    self.choices[c.index].add(c)
                self.finished = out.finished
                if on_delta is not None:
                    await on_delta(self, out)
        except (ValueError, EngineDeadError, EngineGenerateError) as e:
            # An output constraint the engine refused is named by the request field it came from.
            if isinstance(e, InvalidRequestError) and (refused := constraint_error(str(e), self.constraint_param)):
                raise refused from None
            raise engine_api_error(e, self.request_id, accepted=not first) from None
        except anyio.get_cancelled_exc_class():  # the client went away: the request was aborted
            if not self.finished:
                self.timer.finished(["abort"] * len(self.choices))
            raise

    def report(self, finish_reasons: Sequence[str] | None = None) -> None:
        """Count the finished choices (by their final finish reasons, e.g. "tool_calls") in the metrics."""
        self.timer.finished(list(finish_reasons) if finish_reasons is not None
                            else [c.finish_reason or "abort" for c in self.choices])

    @property
    def num_generated(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


def engine_api_error(e: ValueError | EngineDeadError | EngineGenerateError, request_id: str, *,
                     accepted: bool, prompt_param: str = "prompt") -> APIError:
    """The answer to an error of an engine request (`accepted`: it had produced output): a 400 for its input's
    fault (naming the request's prompt field `prompt_param` when it is about the prompt), a 503 for a dead or busy
    engine, else a 500 whose details stay in the log."""
    if isinstance(e, InvalidRequestError):  # the engine refused the input (e.g. a grammar that does not compile)
        return bad_request(str(e), _param_of(str(e), prompt_param))
    if isinstance(e, ValueError):
        if accepted:
            return unexpected_error(e, request_id)  # not the input's fault
        # the prompt or the params, found when the request was submitted
        return bad_request(str(e), _param_of(str(e), prompt_param))
    if isinstance(e, EngineDeadError):
        return APIError(f"The engine is not running: {e}", 503, code="engine_dead")
    if isinstance(e, EngineOverloadedError):  # no capacity in time (a busy compile pool): the client may retry
        return APIError(str(e), 503, code="overloaded", headers={"Retry-After": "1"})
    return unexpected_error(e, request_id)  # the engine failed this request alone: its log says why


def make_jobs(prompts: Sequence[list[int]], params: SamplingParams, base_id: str, metrics: ServerMetrics,
              endpoint: str, start: float, constraint_param: str | None = None) -> list[EngineJob]:
    """One job per prompt; choice indices run prompt by prompt (prompt i has i*n .. i*n + n - 1).
    `constraint_param` names the field the output constraint came from, for the engine's refusals of it."""
    n = params.n
    return [EngineJob(request_id=base_id if len(prompts) == 1 else f"{base_id}-{i}", prompt_ids=ids,
                      params=params, first_index=i * n, timer=RequestTimer(metrics, endpoint, start),
                      constraint_param=constraint_param)
            for i, ids in enumerate(prompts)]


# The engine's words for a constraint it cannot compile (vx/core/structured_output.py).
_ENGINE_CONSTRAINT = re.compile(r"structured_outputs\.(\w+) (.*)", re.DOTALL)
_CONSTRAINT_WORDS = {"json": "the JSON schema", "regex": "the regex", "grammar": "the grammar",
                     "choice": "the choices", "json_object": "the JSON object constraint",
                     "structural_tag": "the constraint"}


def constraint_error(message: str, param: str | None) -> APIError | None:
    """The engine's refusal of an output constraint as a 400 naming the request field it came from (`param`,
    e.g. `tools.0.function.parameters`), not the engine's internal name for it; None for other refusals."""
    found = _ENGINE_CONSTRAINT.search(message)
    if found is None or param is None:
        return None
    return bad_request(f"{param}: {_CONSTRAINT_WORDS.get(found.group(1), 'the constraint')} {found.group(2)}", param)


async def run_jobs(llm: Any, jobs: list[EngineJob], on_delta: OnDelta | None = None) -> None:
    """Run the jobs concurrently; the first error (unwrapped from the task group's) is raised."""
    if len(jobs) == 1:
        await jobs[0].run(llm, on_delta)
        return
    try:
        async with anyio.create_task_group() as tg:
            for job in jobs:
                tg.start_soon(job.run, llm, on_delta)
    except BaseExceptionGroup as group:
        raise _first_error(group) from None


def _first_error(group: BaseExceptionGroup) -> BaseException:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_error(exc)
        if not isinstance(exc, anyio.get_cancelled_exc_class()):
            return exc
    return group.exceptions[0]


def _param_of(message: str, prompt_param: str = "prompt") -> str | None:
    lowered = message.lower()
    if lowered.startswith("n="):
        return "n"
    if "prompt" in lowered:
        return prompt_param
    return None


def now() -> float:
    """The clock request timings use."""
    return time.perf_counter()
