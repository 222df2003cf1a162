"""Per-request state the runner keeps between steps, and the flattened tensors of one step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vx.gpu.sampling_metadata import make_generator
from vx.pooling_params import PoolingParams
from vx.sampling_params import SamplingParams
from vx.step import SchedulerOutput


@dataclass
class CachedRequestState:
    """What the runner remembers of a live request: its tokens (the prompt, and the output the scheduler sent),
    how many have KV in the cache, its block table and its sampling RNG."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # one block table per KV-cache group
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    eos_token_ids: tuple[int, ...] = ()
    bad_words_token_ids: list[list[int]] | None = None
    # An embedding request: how it pools, and (mean pooling) the sum of its hidden states over the chunks so far.
    pooling_params: PoolingParams | None = None
    pooled_sum: torch.Tensor | None = None
    num_pooled_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, count: int) -> list[int]:
        """Its tokens [start, start + count), across the prompt and the output."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:start - num_prompt + count]
        return (self.prompt_token_ids[start:start + count]
                + self.output_token_ids[:max(0, start + count - num_prompt)])


@dataclass
class StepInputs:
    """One step's model inputs, flattened over all scheduled requests."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    query_start_loc: np.ndarray  # int32 [B+1]
    seq_lens: np.ndarray  # int32 [B]
    block_tables: list[np.ndarray]  # int32 [B, max_blocks], one per KV-cache group
    slot_mappings: list[np.ndarray]  # int64 [T], one per KV-cache group
    logits_indices: torch.Tensor  # int64 [S]: the last token of each sampling request
    sampling_req_ids: list[str]
    sampling_states: list[CachedRequestState]
    max_query_len: int
    max_seq_len: int
    pooling_rows: list[int] = field(default_factory=list)  # batch rows of the pooling requests

    @property
    def block_table(self) -> np.ndarray:
        """The first group's block table (the only one of most models)."""
        return self.block_tables[0]

    @property
    def slot_mapping(self) -> np.ndarray:
        """The first group's slots."""
        return self.slot_mappings[0]


class InputBatch:
    """Tracks live requests across steps and turns a `SchedulerOutput` into `StepInputs`."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.states: dict[str, CachedRequestState] = {}
        # Generators of preempted requests: a resumed request draws on from where it stopped, so that a
        # seeded request's text does not depend on whether memory pressure preempted it.
        self.parked_generators: dict[str, torch.Generator | None] = {}
        # The live pooling requests: while there are none, a step spends nothing on pooling.
        self.pooling_req_ids: set[str] = set()

    def update_states(self, scheduler_output: SchedulerOutput) -> dict[str, str]:
        """Drop ended requests, park preempted ones, register new (or resumed) ones, and bring the running ones up
        to date (their new tokens and blocks).

        Returns req id -> message for each new request whose sampling state could not be prepared (its generator):
        it is registered all the same, so that its tokens still run in this step's forward pass (its blocks may be
        shared with another request in this very step), but it must not sample, and must end.
        """
        failed: dict[str, str] = {}
        for req_id in scheduler_output.finished_req_ids:
            self.states.pop(req_id, None)
            self.parked_generators.pop(req_id, None)
            self.pooling_req_ids.discard(req_id)
        for req_id in scheduler_output.preempted_req_ids:
            state = self.states.pop(req_id, None)
            if state is not None:
                self.parked_generators[req_id] = state.generator
            self.pooling_req_ids.discard(req_id)  # its partial sum is gone: it starts over when it resumes
        for new in scheduler_output.scheduled_new_reqs:
            old = self.states.get(new.req_id)  # preempted and resumed within one step
            if old is not None:
                generator = old.generator
            elif new.req_id in self.parked_generators:
                generator = self.parked_generators.pop(new.req_id)
            else:
                try:
                    generator = make_generator(new.sampling_params.seed, self.device)
                except Exception as e:  # noqa: BLE001 - this request fails alone
                    generator = None
                    failed[new.req_id] = f"preparing its sampling failed: {type(e).__name__}: {e}"
            # Copies: the runner appends to them, and the scheduler's lists may live in another process.
            self.states[new.req_id] = CachedRequestState(
                req_id=new.req_id, prompt_token_ids=new.prompt_token_ids, sampling_params=new.sampling_params,
                block_ids=[list(ids) for ids in new.block_ids], num_computed_tokens=new.num_computed_tokens,
                output_token_ids=list(new.output_token_ids), generator=generator,
                eos_token_ids=tuple(new.eos_token_ids), bad_words_token_ids=new.bad_words_token_ids,
                pooling_params=new.pooling_params)
            if new.pooling_params is not None:
                self.pooling_req_ids.add(new.req_id)
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.states[cached.req_id]
            state.num_computed_tokens = cached.num_computed_tokens
            state.output_token_ids.extend(cached.new_token_ids)
            for table, new_ids in zip(state.block_ids, cached.new_block_ids):
                table.extend(new_ids)
        return failed

    def prepare(self, scheduler_output: SchedulerOutput) -> StepInputs:
        """Flatten the scheduled requests (in batch order) into token ids, positions, slots and a padded block
        table; a request samples when this step reaches the end of its tokens."""
        bs = self.block_size
        states = [self.states[req_id] for req_id in scheduler_output.req_ids]
        n = len(states)
        num_sched = np.fromiter((scheduler_output.num_scheduled_tokens[s.req_id] for s in states), dtype=np.int32,
                                count=n)
        computed = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int32, count=n)
        qsl = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(num_sched, out=qsl[1:])
        total = int(qsl[-1])
        seq_lens = computed + num_sched

        token_ids: list[int] = []
        for s, count in zip(states, num_sched.tolist()):
            token_ids.extend(s.token_ids(s.num_computed_tokens, count))
        # position of each token = its request's computed count + its offset inside the request
        req_idx = np.repeat(np.arange(n, dtype=np.int64), num_sched)
        positions = (np.arange(total, dtype=np.int64) - qsl[:-1].astype(np.int64)[req_idx]
                     + computed.astype(np.int64)[req_idx])

        block_tables, slot_mappings = [], []
        for group in range(len(states[0].block_ids) if states else 1):
            max_blocks = max((len(s.block_ids[group]) for s in states), default=1) or 1
            block_table = np.zeros((n, max_blocks), dtype=np.int32)
            for i, s in enumerate(states):
                block_table[i, :len(s.block_ids[group])] = s.block_ids[group]
            block_tables.append(block_table)
            slot_mappings.append(block_table[req_idx, positions // bs].astype(np.int64) * bs + positions % bs)

        sampling_rows = [i for i, s in enumerate(states) if seq_lens[i] >= s.num_tokens]
        pooling_rows: list[int] = []
        if self.pooling_req_ids:  # a pooling request never samples
            pooling_rows = [i for i, s in enumerate(states) if s.pooling_params is not None]
            sampling_rows = [i for i in sampling_rows if states[i].pooling_params is None]
        logits_indices = torch.from_numpy(qsl[1:][sampling_rows].astype(np.int64) - 1)
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64),
            positions=torch.from_numpy(positions),
            query_start_loc=qsl,
            seq_lens=seq_lens.astype(np.int32),
            block_tables=block_tables,
            slot_mappings=slot_mappings,
            logits_indices=logits_indices,
            sampling_req_ids=[states[i].req_id for i in sampling_rows],
            sampling_states=[states[i] for i in sampling_rows],
            max_query_len=int(num_sched.max()) if n else 0,
            max_seq_len=int(seq_lens.max()) if n else 0,
            pooling_rows=pooling_rows,
        )
