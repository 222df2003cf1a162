"""The workers' side of the step contract in plain Python, for scheduler tests: what a worker knows of each request
after each `SchedulerOutput` (whole once as `NewRequestData`, then only what changed as `CachedRequestData`), and
so which tokens it computes and which requests sample. A test that checks these shares against the scheduler's own
records checks that the plan says enough."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vx.step import SchedulerOutput


@dataclass
class Share:
    """One request's share of a step, as a worker reconstructs it."""

    req_id: str
    is_new: bool  # sent whole in this step (first scheduled, or resumed after preemption)
    token_ids: list[int]  # the tokens it computes now, from position `num_computed_tokens` on
    num_computed_tokens: int
    new_block_ids: list[int]  # its whole block table when is_new, else the blocks added in this step (first group)
    samples: bool  # this step reaches the end of its tokens


@dataclass
class ViewedStep:
    """A `SchedulerOutput` with the shares a worker made of it (`scheduled`, in batch order)."""

    output: SchedulerOutput
    scheduled: list[Share]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.output, name)


@dataclass
class WorkerView:
    """Applies each step's plan the way a worker does, keeping each live request's tokens."""

    tokens: dict[str, list[int]] = field(default_factory=dict)

    def apply(self, scheduler_output: SchedulerOutput) -> ViewedStep:
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self.tokens.pop(req_id, None)
        shares: list[Share] = []
        for cached in scheduler_output.scheduled_cached_reqs:
            tokens = self.tokens[cached.req_id]
            tokens.extend(cached.new_token_ids)
            shares.append(self._share(scheduler_output, cached.req_id, False, cached.num_computed_tokens,
                                      cached.new_block_ids))
        for new in scheduler_output.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            shares.append(self._share(scheduler_output, new.req_id, True, new.num_computed_tokens, new.block_ids))
        assert [share.req_id for share in shares] == scheduler_output.req_ids
        return ViewedStep(scheduler_output, shares)

    def _share(self, scheduler_output: SchedulerOutput, req_id: str, is_new: bool, num_computed: int,
               block_ids: list[list[int]]) -> Share:
        tokens = self.tokens[req_id]
        count = scheduler_output.num_scheduled_tokens[req_id]
        return Share(req_id, is_new, tokens[num_computed:num_computed + count], num_computed, list(block_ids[0]),
                     num_computed + count >= len(tokens))
