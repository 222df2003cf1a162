"""Turns the engine's new token ids into `RequestOutput`s: detokenize, apply stop strings, shape per output_kind.

Runs in the application's process, one `OutputProcessor` per client. A request's state lives here from
`add_request` until it finishes (engine finish, stop string, or abort) and is dropped at once afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from vx.client.detokenizer import IncrementalDetokenizer
from vx.core.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from vx.outputs import CompletionOutput, RequestOutput
from vx.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class ProcessedOutputs:
    """What one batch of engine outputs produced for the application, and what the engine must drop."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    # Requests finished here by a stop string while the engine still runs them: the caller must abort them.
    reqs_to_abort: list[str] = field(default_factory=list)


class RequestState:
    """Everything the client tracks for one in-flight request."""

    def __init__(self, request: EngineCoreRequest, prompt: str | None, tokenizer: Any) -> None:
        self.request_id = request.request_id
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
        if self.output_kind == RequestOutputKind.DELTA:
            text, ids = self.text[self.sent_text:end], self.token_ids[self.sent_tokens:]
            self.sent_text, self.sent_tokens = end, len(self.token_ids)
        else:
            text, ids = self.text[:end], list(self.token_ids)
        completion = CompletionOutput(
            index=0, text=text, token_ids=ids, finish_reason=self.finish_reason, stop_reason=self.stop_reason
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
        )


class OutputProcessor:
    """Client-side output path: per-request detokenization, stop strings and output shaping."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer  # a fast HF tokenizer, or None to return token ids only (text stays '')
        self.request_states: dict[str, RequestState] = {}

    def add_request(self, request: EngineCoreRequest, prompt: str | None = None) -> None:
        """Start tracking `request` (as sent to the engine); `prompt` is the original text, if any."""
        if request.request_id in self.request_states:
            raise ValueError(f"Request id {request.request_id!r} is already in flight; request ids must be unique.")
        self.request_states[request.request_id] = RequestState(request, prompt, self.tokenizer)

    def has_unfinished_requests(self) -> bool:
        """True while some request still awaits outputs."""
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        """How many requests still await outputs."""
        return len(self.request_states)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply one batch of engine outputs; return the outputs now due and the requests to abort in the engine.

        Outputs for unknown request ids (e.g. steps that raced with an abort or a stop string) are ignored.
        """
        result = ProcessedOutputs()
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue
            if out.num_cached_tokens:
                state.num_cached_tokens = out.num_cached_tokens
            state.append(list(out.new_token_ids), out.finish_reason)
            if state.finished:  # a stop string matched
                if out.finish_reason is None:
                    result.reqs_to_abort.append(out.request_id)
            elif out.finish_reason is not None:
                state.finish_reason = str(FinishReason(out.finish_reason))
                state.stop_reason = out.stop_reason
            request_output = state.make_output()
            if request_output is not None:
                result.request_outputs.append(request_output)
            if state.finished:
                del self.request_states[out.request_id]
        return result

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Drop the given requests; return a final output (finish_reason 'abort') for each one that was known."""
        finals: list[RequestOutput] = []
        for rid in request_ids:
            state = self.request_states.pop(rid, None)
            if state is None:
                continue
            if state.detokenizer is not None:
                state.text += state.detokenizer.flush()
            state.finish_reason, state.stop_reason = "abort", None
            request_output = state.make_output()
            if request_output is not None:
                finals.append(request_output)
        return finals
