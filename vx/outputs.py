"""What a request returns to the application, and the engine's counters."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log-probability of one token at one position, its rank there (1 = most likely), and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs: token id -> Logprob (the chosen token, plus the top-k asked for).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (index < n)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cumulative_logprob: float | None = None  # sum of the chosen tokens' logprobs, when logprobs were asked for
    logprobs: list[PositionLogprobs] | None = None  # one per generated token, when `logprobs` was set

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request as seen by the application, cumulative or delta per its output_kind."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # One per prompt token when `prompt_logprobs` was set; the first is None (nothing predicts it).
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class EmbeddingOutput:
    """One prompt's embedding: its pooled final hidden states (L2-normalised unless the request said not to)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """The result of one embedding request (`LLM.embed`, `AsyncLLM.embed`), as vLLM's `EmbeddingRequestOutput`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prompt: str | None = None


@dataclass
class EngineStats:
    """A snapshot of the engine: queues, KV blocks, prefix-cache hits, preemptions, steps."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_in_use: int = 0
    kv_blocks_cached: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
