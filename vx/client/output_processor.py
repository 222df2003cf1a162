"""Turns the engine's new token ids into `RequestOutput`s: detokenize, apply stop strings, shape per output_kind.

Runs in the application's process, one `OutputProcessor` per client. A request's state lives here from
`add_request` until it finishes (engine finish, stop string, or abort) and is dropped at once afterwards. It is the
front end's one request table: a streaming front end (`AsyncLLM`) also keeps each request's output queue here.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Protocol

from vx.client.detokenizer import IncrementalDetokenizer
from vx.client.parallel_sampling import ParentRequest
from vx.core.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from vx.step import TokenLogprobs
from vx.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, PositionLogprobs,
                        RequestOutput)
from vx.sampling_params import RequestOutputKind, SamplingParams


class OutputQueue(Protocol):
    """Where a request's outputs go when its consumer reads them as they come (`vx.client.request_stream`)."""

    def put(self, output: RequestOutput | EmbeddingRequestOutput) -> None: ...

    def fail(self, error: BaseException) -> None: ...


class QueueHolder:
    """The optional output queue of one request's state, held weakly: a consumer that drops its queue unread lets
    it be garbage-collected, and the queue's own finalizer then aborts the request."""

    def __init__(self, queue: OutputQueue | None) -> None:
        self._queue_ref = weakref.ref(queue) if queue is not None else None

    @property
    def has_queue(self) -> bool:
        """Whether the request was given a queue (its outputs go there, not to `process_outputs`' result)."""
        return self._queue_ref is not None

    @property
    def queue(self) -> OutputQueue | None:
        """The queue while its consumer still holds it; None without one (the sync `LLM`) or once it is gone."""
        return self._queue_ref() if self._queue_ref is not None else None


@dataclass
class ProcessedOutputs:
    """What one batch of engine outputs produced for the application, and what the engine must drop."""

    request_outputs: list[RequestOutput | EmbeddingRequestOutput] = field(default_factory=list)
    # Requests finished here by a stop string while the engine still runs them: the caller must abort them.
    reqs_to_abort: list[str] = field(default_factory=list)


class RequestState(QueueHolder):
    """Everything the client tracks for one in-flight request (a child of an n > 1 one shares its parent's queue)."""

    def __init__(self, request: EngineCoreRequest, prompt: str | None, tokenizer: Any,
                 parent: ParentRequest | None = None, queue: OutputQueue | None = None) -> None:
        super().__init__(queue)
        self.request_id = request.request_id
        self.parent = parent  # set for a child of an n > 1 request: its outputs go through the parent
        self.prompt = prompt
        self.prompt_token_ids = list(request.prompt_token_ids)
        self.params: SamplingParams = request.sampling_params
        self.output_kind = self.params.output_kind
        self.stop: list[str] = list(self.params.stop or [])
        # Text that could still be the start of a stop string is not shown until it is decided.
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, self.prompt_token_ids, self.params.skip_special_tokens)
            if tokenizer is not None else None
        )
        self.text = ""  # all decoded text so far (cut at a stop string once one is found)
        self.token_ids: list[int] = []
        self.sent_text = 0  # DELTA: chars / token ids already returned
        self.sent_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # Logprobs, when asked for: one dict per output token (aligned with token_ids), and of the prompt.
        self.logprobs: list[PositionLogprobs] | None = [] if self.params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if self.params.logprobs is not None else None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = \
            [None] if self.params.prompt_logprobs is not None else None
        self.sent_prompt_logprobs = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, new_ids: list[int], engine_finish: FinishReason | None) -> None:
        """Add an engine step's tokens, decode them, and look for a stop string in the new text."""
        self.token_ids.extend(new_ids)
        if self.detokenizer is None:
            return
        decode_ids = new_ids
        # A stop token (eos / stop_token_ids) ends the request without showing its text, as in vLLM.
        if engine_finish == FinishReason.STOP and new_ids and not self.params.include_stop_str_in_output:
            decode_ids = new_ids[:-1]
        old_len = len(self.text)
        self.text += self.detokenizer.push(decode_ids)
        if engine_finish is not None:
            self.text += self.detokenizer.flush()  # the request ends: a partial character shows as U+FFFD
        if self.stop:
            self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> None:
        """Find the earliest stop string that ends in text added after `old_len`, and cut the text there."""
        best: tuple[int, int, str] | None = None  # (position, order in params.stop, stop string)
        for order, s in enumerate(self.stop):
            pos = self.text.find(s, max(0, old_len - len(s) + 1))
            if pos >= 0 and (best is None or (pos, order) < best[:2]):
                best = (pos, order, s)
        if best is None:
            return
        pos, _, s = best
        self.text = self.text[: pos + len(s)] if self.params.include_stop_str_in_output else self.text[:pos]
        self.finish_reason, self.stop_reason = "stop", s

    def visible_len(self) -> int:
        """How much of the text may be shown now: all of it once finished, else all but the held-back tail."""
        if self.finished:
            return len(self.text)
        return max(self.sent_text, len(self.text) - self.hold_back)

    def make_output(self) -> RequestOutput | None:
        """The output due now per output_kind (None for FINAL_ONLY before the end); advances DELTA offsets."""
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        end = self.visible_len()
        logprobs = self.logprobs
        prompt_logprobs = self.prompt_logprobs
        if self.output_kind == RequestOutputKind.DELTA:
            text, ids = self.text[self.sent_text:end], self.token_ids[self.sent_tokens:]
            if logprobs is not None:
                logprobs = logprobs[self.sent_tokens:]
            if self.sent_prompt_logprobs:
                prompt_logprobs = None  # a delta carries the prompt's logprobs once
            self.sent_text, self.sent_tokens = end, len(self.token_ids)
        else:
            text, ids = self.text[:end], list(self.token_ids)
            if logprobs is not None:
                logprobs = list(logprobs)
        # Sent once they are complete: with the first token (or the end, for a request that never got one).
        if prompt_logprobs is not None and not (self.token_ids or self.finished):
            prompt_logprobs = None
        self.sent_prompt_logprobs = self.sent_prompt_logprobs or prompt_logprobs is not None
        completion = CompletionOutput(
            index=0, text=text, token_ids=ids, finish_reason=self.finish_reason, stop_reason=self.stop_reason,
            cumulative_logprob=self.cumulative_logprob, logprobs=logprobs,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    def add_logprobs(self, new: TokenLogprobs, decode: Any) -> None:
        """Record the logprobs of the tokens just appended."""
        if self.logprobs is None:
            return
        positions = to_position_logprobs(new, decode)
        self.logprobs.extend(positions)
        self.cumulative_logprob += sum(lp[0] for lp in new.logprobs)

    def add_prompt_logprobs(self, prompt: TokenLogprobs, decode: Any) -> None:
        """The prompt's logprobs, all positions but the first (nothing predicts it)."""
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = [None, *to_position_logprobs(prompt, decode)]


class PoolingRequestState(QueueHolder):
    """What the client tracks for one embedding request: nothing streams, its one output carries the embedding."""

    parent = None  # never an n > 1 request

    def __init__(self, request: EngineCoreRequest, prompt: str | None, queue: OutputQueue | None = None) -> None:
        super().__init__(queue)
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = list(request.prompt_token_ids)

    def make_output(self, out: EngineCoreOutput) -> EmbeddingRequestOutput | None:
        """The request's output once the engine ended it with its embedding; None before."""
        if out.pooled is None:
            return None
        return EmbeddingRequestOutput(request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
                                      outputs=EmbeddingOutput(out.pooled), finished=True,
                                      num_cached_tokens=out.num_cached_tokens, prompt=self.prompt)


def to_position_logprobs(tl: TokenLogprobs, decode: Any) -> list[PositionLogprobs]:
    """One {token id: Logprob} per position: the chosen token with its rank, then the top-k with ranks 1..k."""
    out = []
    for ids, lps, rank in zip(tl.token_ids, tl.logprobs, tl.ranks):
        position = {tid: Logprob(lp, r, decode(tid)) for r, (tid, lp) in enumerate(zip(ids[1:], lps[1:]), 1)}
        position.setdefault(ids[0], Logprob(lps[0], rank, decode(ids[0])))
        # The chosen token first, as vLLM lists it.
        out.append({ids[0]: position.pop(ids[0]), **position})
    return out


class OutputProcessor:
    """Client-side output path: per-request detokenization, stop strings, logprobs and output shaping.

    A request with n > 1 is tracked as a `ParentRequest` over n child states (one per engine request); the
    application only ever sees the parent's id.

    Use it from one thread, the owner's, but for `drop`, which anyone may call: a queue's finalizer runs in any
    thread, or in the owner's thread while a method here walks the table. So a drop that cannot happen at once is
    recorded, and done at the start of the next method that walks the table.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer  # a fast HF tokenizer, or None to return token ids only (text stays '')
        self.request_states: dict[str, RequestState | PoolingRequestState] = {}  # by engine request id
        self.parent_requests: dict[str, ParentRequest] = {}  # n > 1 requests, by the application's id
        self._token_text: dict[int, str] = {}  # decoded single tokens, for logprobs
        # Drops recorded where they could not happen at once: (application's id, weak ref to its queue or None).
        self.deferred_drops: collections.deque[tuple[str, weakref.ref[OutputQueue] | None]] = collections.deque()
        self._walking = False  # a method is walking the table (a drop now would change it under that method)

    @contextlib.contextmanager
    def _walk(self) -> Iterator[None]:
        """Around every method that changes the table: do the deferred drops first, and defer drops meanwhile."""
        if self._walking:  # nested in another method, which did the drops
            yield
            return
        self._walking = True
        try:
            while self.deferred_drops:
                rid, ref = self.deferred_drops.popleft()
                self._drop_if_current(rid, ref() if ref is not None else None)
            yield
        finally:
            self._walking = False

    def drop(self, request_id: str, queue: OutputQueue | None, *, now: bool) -> None:
        """Forget `request_id` (its output goes nowhere), but only while `queue` is still its queue (None: while its
        queue is gone), since the id may name a newer request by then. `now`: the caller is on the owner's thread;
        the drop still waits if a method is walking the table. Safe from any thread."""
        if now and not self._walking:
            with self._walk():
                self._drop_if_current(request_id, queue)
        else:
            self.deferred_drops.append((request_id, weakref.ref(queue) if queue is not None else None))

    def do_deferred_drops(self) -> None:
        """Do the drops recorded so far now (from the owner's thread, outside any method here)."""
        with self._walk():
            pass

    def _drop_if_current(self, request_id: str, queue: OutputQueue | None) -> None:
        if self.queue_of(request_id) is queue:
            self.abort_requests([request_id])

    def queue_of(self, request_id: str) -> OutputQueue | None:
        """The output queue of a request (the application's id); None if it has none, is gone, or is unknown."""
        parent = self.parent_requests.get(request_id)
        for rid in parent.child_ids if parent is not None else (request_id,):
            state = self.request_states.get(rid)
            if state is not None:
                return state.queue if state.parent is parent else None
        return None

    def queues(self) -> list[OutputQueue]:
        """The queue of every request still tracked that has one."""
        queues = (self.queue_of(rid) for rid in self.request_ids())
        return [q for q in queues if q is not None]

    def add_request(self, request: EngineCoreRequest, prompt: str | None = None,
                    queue: OutputQueue | None = None) -> list[EngineCoreRequest]:
        """Start tracking `request`; `prompt` is the original text, if any; `queue`, if given, receives its outputs
        (`process_outputs` then does not return them). Returns the requests to send to the engine: `request` itself,
        or its n children when `n > 1`."""
        with self._walk():
            return self._add_request(request, prompt, queue)

    def _add_request(self, request: EngineCoreRequest, prompt: str | None,
                     queue: OutputQueue | None) -> list[EngineCoreRequest]:
        rid = request.request_id
        if rid in self.request_states or rid in self.parent_requests:
            raise ValueError(f"Request id {rid!r} is already in flight; request ids must be unique.")
        if request.pooling_params is not None:
            self.request_states[rid] = PoolingRequestState(request, prompt, queue)
            return [request]
        if request.sampling_params.n == 1:
            self.request_states[rid] = RequestState(request, prompt, self.tokenizer, queue=queue)
            return [request]
        parent = ParentRequest(request, prompt)
        children = parent.child_requests()
        clash = [c.request_id for c in children if c.request_id in self.request_states]
        if clash:
            raise ValueError(f"Request id {clash[0]!r} (a child of {rid!r}) is already in flight.")
        self.parent_requests[rid] = parent
        for child in children:
            self.request_states[child.request_id] = RequestState(child, prompt, self.tokenizer, parent, queue)
        return children

    def engine_request_ids(self, request_ids: Iterable[str]) -> list[str]:
        """The engine's ids for the application's ids (an n > 1 request is its children)."""
        out: list[str] = []
        for rid in request_ids:
            parent = self.parent_requests.get(rid)
            out.extend(parent.child_ids if parent is not None else (rid,))
        return out

    def request_ids(self) -> list[str]:
        """The application's ids of every request still tracked."""
        return [*self.parent_requests, *(rid for rid, s in self.request_states.items() if s.parent is None)]

    def drop_failed(self, engine_request_id: str) -> tuple[str, list[str]]:
        """An engine request failed (the engine refused it): drop its whole request, every sample of an n > 1
        one. Returns the application's id and the engine ids of the other samples, which the engine must abort."""
        with self._walk():
            rid = self.request_id_of(engine_request_id)
            others = [e for e in self.engine_request_ids([rid]) if e != engine_request_id]
            self.abort_requests([rid])
            return rid, others

    def request_id_of(self, engine_request_id: str) -> str:
        """The application's id for an engine request id (a child's parent)."""
        state = self.request_states.get(engine_request_id)
        if state is not None and state.parent is not None:
            return state.parent.request_id
        return engine_request_id

    def has_unfinished_requests(self) -> bool:
        """True while some request still awaits outputs."""
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        """How many requests (as the application counts them) still await outputs."""
        if not self.parent_requests:
            return len(self.request_states)
        return len(self.parent_requests) + sum(1 for s in self.request_states.values() if s.parent is None)

    def _decode_token(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""
            self._token_text[token_id] = text
        return text

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply one batch of engine outputs; return the outputs now due and the requests to abort in the engine.

        An output due for a request with a queue goes into the queue instead of the result. Outputs for unknown
        request ids (e.g. steps that raced with an abort or a stop string) are ignored.
        """
        with self._walk():
            return self._process_outputs(outputs)

    def _process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        result = ProcessedOutputs()
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue
            if isinstance(state, PoolingRequestState):
                embedding = state.make_output(out)
                if out.finished:
                    del self.request_states[out.request_id]
                if embedding is not None:
                    self._deliver(state, embedding, result)
                continue
            if out.num_cached_tokens:
                state.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                state.add_prompt_logprobs(out.prompt_logprobs, self._decode_token)
            state.append(list(out.new_token_ids), out.finish_reason)
            if out.new_logprobs is not None:
                state.add_logprobs(out.new_logprobs, self._decode_token)
            if state.finished:  # a stop string matched
                if out.finish_reason is None:
                    result.reqs_to_abort.append(out.request_id)
            elif out.finish_reason is not None:
                state.finish_reason = str(FinishReason(out.finish_reason))
                state.stop_reason = out.stop_reason
            request_output = state.make_output()
            if state.finished:
                del self.request_states[out.request_id]
            if request_output is not None and state.parent is not None:
                request_output = state.parent.add_child_output(out.request_id, request_output)
                if state.parent.finished:
                    self.parent_requests.pop(state.parent.request_id, None)
            if request_output is not None:
                self._deliver(state, request_output, result)
        return result

    @staticmethod
    def _deliver(state: RequestState | PoolingRequestState, output: RequestOutput | EmbeddingRequestOutput,
                 result: ProcessedOutputs) -> None:
        if not state.has_queue:
            result.request_outputs.append(output)
            return
        queue = state.queue
        if queue is not None:  # else its consumer is gone, and its finalizer is aborting the request
            queue.put(output)

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Drop the given requests (the application's ids); return a final output (finish_reason 'abort') for
        each one that was known. The queues, if any, get nothing: the caller says how their requests end."""
        with self._walk():
            return self._abort_requests(request_ids)

    def _abort_requests(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        finals: list[RequestOutput] = []
        for rid in request_ids:
            parent = self.parent_requests.pop(rid, None)
            if parent is None:
                final = self._abort_state(rid)
                if final is not None:
                    finals.append(final)
                continue
            for cid in parent.child_ids:  # the last output is the parent's final one
                child_final = self._abort_state(cid)
                output = parent.add_child_output(cid, child_final) if child_final is not None else None
                if output is not None:
                    finals.append(output)
        return finals

    def _abort_state(self, engine_request_id: str) -> RequestOutput | None:
        state = self.request_states.pop(engine_request_id, None)
        if state is None or isinstance(state, PoolingRequestState):
            return None  # an aborted embedding request has no output: its caller hears of the abort
        if state.detokenizer is not None:
            state.text += state.detokenizer.flush()
        state.finish_reason, state.stop_reason = "abort", None
        return state.make_output()
