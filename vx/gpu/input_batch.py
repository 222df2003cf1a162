"""Per-request state the runner keeps between steps, and the flattened tensors of one step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vx.gpu.sampling_metadata import make_generator
from vx.sampling_params import SamplingParams
from vx.step import SchedulerOutput


@dataclass
class CachedRequestState:
    """What the runner remembers of a live request: its block table, its sampling RNG, and the tokens the
    logits processors look at. `output_token_ids` is the runner's own list: it appends each token it samples."""

    req_id: str
    block_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = ()
    bad_words_token_ids: list[list[int]] | None = None


@dataclass
class StepInputs:
    """One step's model inputs, flattened over all scheduled requests."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    query_start_loc: np.ndarray  # int32 [B+1]
    seq_lens: np.ndarray  # int32 [B]
    block_table: np.ndarray  # int32 [B, max_blocks]
    slot_mapping: np.ndarray  # int64 [T]
    logits_indices: torch.Tensor  # int64 [S]: the last token of each sampling request
    sampling_req_ids: list[str]
    sampling_states: list[CachedRequestState]
    max_query_len: int
    max_seq_len: int


class InputBatch:
    """Tracks live requests across steps and turns a `SchedulerOutput` into `StepInputs`."""

    def __init__(self, block_size: int, device: torch.device, seed: int = 0) -> None:
        self.block_size = block_size
        self.device = device
        self.seed = seed
        self.states: dict[str, CachedRequestState] = {}
        # Generators of preempted requests: a resumed request draws on from where it stopped, so that a
        # seeded request's text does not depend on whether memory pressure preempted it.
        self.parked_generators: dict[str, torch.Generator | None] = {}

    def update_states(self, so: SchedulerOutput) -> dict[str, str]:
        """Drop ended requests, (re)register new ones, extend block tables of running ones.

        Returns req id -> message for each new request whose sampling state could not be prepared (its generator):
        it is registered all the same, so that its tokens still run in this step's forward pass (its blocks may be
        shared with another request in this very step), but it must not sample, and must end.
        """
        failed: dict[str, str] = {}
        for rid in so.finished_req_ids:
            self.states.pop(rid, None)
            self.parked_generators.pop(rid, None)
        for rid in so.preempted_req_ids:
            state = self.states.pop(rid, None)
            if state is not None:
                self.parked_generators[rid] = state.generator
        for sr in so.scheduled:
            if sr.is_new:
                old = self.states.get(sr.req_id)
                if old is not None:
                    gen = old.generator
                elif sr.req_id in self.parked_generators:
                    gen = self.parked_generators.pop(sr.req_id)
                else:
                    try:
                        gen = self._make_generator(sr.sampling_params)
                    except Exception as e:  # noqa: BLE001 - this request fails alone
                        gen = None
                        failed[sr.req_id] = f"preparing its sampling failed: {type(e).__name__}: {e}"
                # A copy of the output so far: from here on the runner appends what it samples (the scheduler's
                # list may live in another process, or be appended to at another time).
                self.states[sr.req_id] = CachedRequestState(
                    sr.req_id, list(sr.new_block_ids), sr.sampling_params, gen, list(sr.output_token_ids),
                    sr.prompt_token_ids, tuple(sr.eos_token_ids), sr.bad_words_token_ids)
            elif sr.new_block_ids:
                self.states[sr.req_id].block_ids.extend(sr.new_block_ids)
        return failed

    def append_sampled(self, states: list[CachedRequestState], token_ids: list[int]) -> None:
        """Record one sampled token per sampling row, so next step's penalties see it."""
        for state, tok in zip(states, token_ids):
            state.output_token_ids.append(tok)

    def _make_generator(self, params: SamplingParams) -> torch.Generator | None:
        return None if params.seed is None else make_generator(params.seed, self.device)

    def prepare(self, so: SchedulerOutput) -> StepInputs:
        """Flatten the scheduled requests into positions, slots and a padded block table."""
        bs = self.block_size
        reqs = so.scheduled
        n = len(reqs)
        num_sched = np.fromiter((len(r.token_ids) for r in reqs), dtype=np.int32, count=n)
        computed = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int32, count=n)
        qsl = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(num_sched, out=qsl[1:])
        total = int(qsl[-1])
        seq_lens = computed + num_sched

        token_ids: list[int] = []
        for r in reqs:
            token_ids.extend(r.token_ids)
        # position of each token = its request's computed count + its offset inside the request
        req_idx = np.repeat(np.arange(n, dtype=np.int64), num_sched)
        positions = (np.arange(total, dtype=np.int64) - qsl[:-1].astype(np.int64)[req_idx]
                     + computed.astype(np.int64)[req_idx])

        states = [self.states[r.req_id] for r in reqs]
        max_blocks = max((len(s.block_ids) for s in states), default=1) or 1
        block_table = np.zeros((n, max_blocks), dtype=np.int32)
        for i, s in enumerate(states):
            block_table[i, :len(s.block_ids)] = s.block_ids
        slot_mapping = (block_table[req_idx, positions // bs].astype(np.int64) * bs + positions % bs)

        sampling_rows = [i for i, r in enumerate(reqs) if r.samples]
        logits_indices = torch.from_numpy(qsl[1:][sampling_rows].astype(np.int64) - 1)
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64),
            positions=torch.from_numpy(positions),
            query_start_loc=qsl,
            seq_lens=seq_lens.astype(np.int32),
            block_table=block_table,
            slot_mapping=slot_mapping,
            logits_indices=logits_indices,
            sampling_req_ids=[reqs[i].req_id for i in sampling_rows],
            sampling_states=[states[i] for i in sampling_rows],
            max_query_len=int(num_sched.max()) if n else 0,
            max_seq_len=int(seq_lens.max()) if n else 0,
        )
