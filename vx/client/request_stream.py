"""`RequestStream`: the channel from AsyncLLM's output task to the one consumer of a request (the request's
output queue, kept in the `OutputProcessor`'s state of the request).

The output task must never wait for a consumer, so `put` is synchronous and unbounded in count: outputs that
arrive while the consumer is behind merge into one (DELTA: text and token ids concatenate; CUMULATIVE and
FINAL_ONLY: the latest replaces the older), so a slow consumer holds at most one pending output.
"""

from __future__ import annotations

import dataclasses
import weakref

import anyio

from vx.outputs import CompletionOutput, RequestOutput
from vx.sampling_params import RequestOutputKind


class RequestStream:
    """Pending output (or error) of one request, and a way for its consumer to wait for it."""

    __slots__ = ("request_id", "output_kind", "finalizer", "_pending", "_error", "_event", "__weakref__")

    def __init__(self, request_id: str, output_kind: RequestOutputKind) -> None:
        self.request_id = request_id
        self.output_kind = output_kind
        # Set by the owner: aborts the request if the stream is garbage-collected while it still runs.
        self.finalizer: weakref.finalize | None = None
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event: anyio.Event | None = None

    def put(self, output: RequestOutput) -> None:
        """Hand over an output (a finished one ends the request: the GC safety net goes); never blocks. Call from
        the event loop's thread."""
        if output.finished:
            self.detach()
        if self._pending is not None and self.output_kind == RequestOutputKind.DELTA:
            output = merge_delta(self._pending, output)
        self._pending = output
        self._wake()

    def fail(self, error: BaseException) -> None:
        """End the stream with an error, raised to the consumer after any output still pending (its request is
        over: the GC safety net goes)."""
        self.detach()
        if self._error is None:
            self._error = error
            self._wake()

    def detach(self) -> None:
        """The request ended normally or was aborted by its owner: the GC safety net is no longer needed."""
        if self.finalizer is not None:
            self.finalizer.detach()

    async def get(self) -> RequestOutput:
        """The next (possibly merged) output; raises the stream's error once no output is pending."""
        while True:
            if self._pending is not None:
                output, self._pending = self._pending, None
                return output
            if self._error is not None:
                raise self._error
            event = self._event = anyio.Event()
            await event.wait()

    def _wake(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None


def merge_delta(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One DELTA output equal to `older` followed by `newer` (text, token ids and logprobs concatenated)."""
    by_index = {c.index: c for c in older.outputs}
    merged = []
    for new in newer.outputs:
        old = by_index.pop(new.index, None)
        if old is None:
            merged.append(new)
            continue
        logprobs = None if old.logprobs is None and new.logprobs is None else \
            (old.logprobs or []) + (new.logprobs or [])
        merged.append(CompletionOutput(
            index=new.index, text=old.text + new.text, token_ids=old.token_ids + new.token_ids,
            finish_reason=new.finish_reason, stop_reason=new.stop_reason,
            cumulative_logprob=new.cumulative_logprob, logprobs=logprobs))
    merged.extend(by_index.values())  # sequences without news in `newer` keep theirs
    merged.sort(key=lambda c: c.index)
    return dataclasses.replace(newer, outputs=merged, metrics={**older.metrics, **newer.metrics},
                               prompt_logprobs=newer.prompt_logprobs or older.prompt_logprobs)
