"""The engine's view of one request: its tokens, how many have KV computed, and its state."""

from __future__ import annotations

import enum
import time

from vx.core.protocol import EngineCoreRequest, FinishReason
from vx.pooling_params import PoolingParams
from vx.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; the finished states carry a finish reason."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """Prompt plus generated tokens; `num_computed_tokens` of them have KV in the cache.

    Prefill and decode are the same thing here: each step the scheduler lets
    `num_computed_tokens` catch up with `num_tokens` under the token budget.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_ids", "arrival_time",
        "priority", "status", "output_token_ids", "all_token_ids", "num_computed_tokens",
        "num_cached_tokens", "block_hashes", "stop_reason", "num_preemptions", "max_tokens",
        "bad_words_token_ids", "prompt_logprobs", "num_output_tokens_sent", "pooling_params", "group",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        bad_words_token_ids: list[list[int]] | None = None,
        pooling_params: PoolingParams | None = None,
        group_id: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids or ())
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.bad_words_token_ids = bad_words_token_ids or None
        self.pooling_params = pooling_params  # set: an embedding request, ended by its pooled prompt
        # What the scheduler's fair share counts as one client: its fan-out's group, else the request itself.
        self.group = group_id if group_id is not None else request_id
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hits at first scheduling; -1 until then
        self.block_hashes: list = []  # filled incrementally by the KV cache manager
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.prompt_logprobs = None  # TokenLogprobs gathered until the first output token carries them
        # How many of its output tokens the workers were sent: the rest go with its next step (CachedRequestData).
        self.num_output_tokens_sent = 0
        mt = sampling_params.max_tokens
        self.max_tokens = mt if mt is not None else 2**62

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest) -> "Request":
        return cls(req.request_id, list(req.prompt_token_ids), req.sampling_params,
                   req.eos_token_ids, req.arrival_time or None, req.priority, req.bad_words_token_ids,
                   req.pooling_params, req.group_id)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
