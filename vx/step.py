"""What the scheduler decided for one step: which requests run how many tokens, on which blocks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from vx.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np


class TokenLogprobs(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """Logprobs at consecutive positions: per position, the chosen (or prompt) token first, then the top-k.

    Raw: the log-softmax of the model's logits, before penalties, temperature or any other processing (as vLLM's
    default). `ranks[j]` is the chosen token's rank at position j (1 = most likely).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def __len__(self) -> int:
        return len(self.ranks)

    def slice(self, start: int, stop: int | None = None) -> "TokenLogprobs":
        """The positions [start, stop)."""
        return TokenLogprobs(token_ids=self.token_ids[start:stop], logprobs=self.logprobs[start:stop],
                             ranks=self.ranks[start:stop])

    def extend(self, other: "TokenLogprobs") -> None:
        """Append `other`'s positions."""
        self.token_ids.extend(other.token_ids)
        self.logprobs.extend(other.logprobs)
        self.ranks.extend(other.ranks)


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    `token_ids` are the tokens to compute now (positions start at `num_computed_tokens`).
    `new_block_ids` are the blocks added since the request was last scheduled; when `is_new` is set
    (first schedule, or resumed after preemption) they are its whole block table.
    """

    req_id: str
    is_new: bool
    token_ids: list[int]
    num_computed_tokens: int
    new_block_ids: list[int]
    sampling_params: SamplingParams
    samples: bool  # True when this step reaches the end of the request's known tokens
    output_token_ids: list[int] = field(default_factory=list)  # the output so far (the runner copies it when is_new)
    # Set when is_new, for the logits processors (repetition penalty, min_tokens, bad words):
    prompt_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = ()
    bad_words_token_ids: list[list[int]] | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """The plan for one engine step, in batch order."""

    scheduled: list[ScheduledRequest]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # ended since the last step: the runner drops their state
    preempted_req_ids: set[str] = field(default_factory=set)
    # Structured output: row i of `grammar_bitmask` (int32 [len(grammar_req_ids), ceil(vocab / 32)], bit t set =
    # token t allowed) masks the logits of request `grammar_req_ids[i]`, one of the requests that sample now.
    grammar_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.scheduled)


@dataclass
class ModelRunnerOutput:
    """What the model produced in one step: a sampled token per request that sampled."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    # Per sampling row, when some row asked for `logprobs`: that row's logprobs (None for rows that did not).
    logprobs: list[TokenLogprobs | None] | None = None
    # req id -> (first prompt position, logprobs of the prompt tokens that follow), for `prompt_logprobs` rows.
    prompt_logprobs: dict[str, tuple[int, TokenLogprobs]] | None = None
    # req id -> error message, for the requests whose own work in this step failed (their sampling state, their
    # sampling); they sampled nothing and must end. An internal error of that request alone: the step went on.
    failed: dict[str, str] = field(default_factory=dict)

    @classmethod
    def empty(cls) -> "ModelRunnerOutput":
        return cls([], [])
