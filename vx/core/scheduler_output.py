"""What the scheduler decided for one step: which requests run how many tokens, on which blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

from vx.sampling_params import SamplingParams


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

    @property
    def num_reqs(self) -> int:
        return len(self.scheduled)


@dataclass
class ModelRunnerOutput:
    """What the model produced in one step: a sampled token per request that sampled."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list | None = None

    @classmethod
    def empty(cls) -> "ModelRunnerOutput":
        return cls([], [])
