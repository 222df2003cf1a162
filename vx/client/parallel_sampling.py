"""Parallel sampling (`n > 1`): one request fans out into n engine requests, whose outputs gather into one.

The children share the prompt, so with prefix caching the engine gives them the prompt's full KV blocks once
(a child admitted after the first, even in the same step, hits the blocks the first one registered). Each
child samples on its own: a seeded request gives child i the seed `seed + i`, so the n samples differ and
the whole request stays reproducible. Only child 0 computes `prompt_logprobs`; the others reuse the cache.
"""

from __future__ import annotations

import dataclasses

import msgspec

from vx.core.protocol import EngineCoreRequest
from vx.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from vx.sampling_params import RequestOutputKind


def child_request_id(index: int, parent_id: str) -> str:
    """The engine's id of child `index` of `parent_id`."""
    return f"{index}_{parent_id}"


class ParentRequest:
    """The client-side state of one n > 1 request: its children's ids and what they have produced."""

    def __init__(self, request: EngineCoreRequest, prompt: str | None = None) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        self.prompt = prompt  # the original text prompt, if any
        self.n = params.n
        self.output_kind = params.output_kind
        self.child_ids = [child_request_id(i, request.request_id) for i in range(self.n)]
        self.index_of = {cid: i for i, cid in enumerate(self.child_ids)}
        self.live = set(range(self.n))
        self.completions: dict[int, CompletionOutput] = {}  # CUMULATIVE / FINAL_ONLY: the latest of each child
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.num_cached_tokens = 0
        self._request = request

    def child_requests(self) -> list[EngineCoreRequest]:
        """The n engine requests: n=1 each, seed + i when seeded, prompt logprobs from child 0 only."""
        params = self._request.sampling_params
        children = []
        for i, cid in enumerate(self.child_ids):
            changes: dict = {"n": 1}
            if params.seed is not None:
                changes["seed"] = (params.seed + i + 2**63) % 2**64 - 2**63  # stays a valid int64
            if i > 0 and params.prompt_logprobs is not None:
                changes["prompt_logprobs"] = None
            children.append(msgspec.structs.replace(self._request, request_id=cid, group_id=self.request_id,
                                                    sampling_params=params.clone(**changes)))
        return children

    @property
    def finished(self) -> bool:
        return not self.live

    def add_child_output(self, child_id: str, output: RequestOutput) -> RequestOutput | None:
        """Fold one child's output in; return the parent's output due now (None when nothing is due)."""
        index = self.index_of[child_id]
        completion = dataclasses.replace(output.outputs[0], index=index)
        if output.finished:
            self.live.discard(index)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if self.output_kind == RequestOutputKind.DELTA:
            # Only what is new: this child's delta (and the prompt logprobs, the once they come).
            return self._output([completion], output.prompt_logprobs)
        self.completions[index] = completion
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        return self._output([self.completions[i] for i in sorted(self.completions)], self.prompt_logprobs)

    def _output(self, completions: list[CompletionOutput],
                prompt_logprobs: list[PositionLogprobs | None] | None) -> RequestOutput:
        req = self._request
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=req.prompt_token_ids,
                             outputs=completions, finished=self.finished, num_cached_tokens=self.num_cached_tokens,
                             prompt_logprobs=prompt_logprobs)
