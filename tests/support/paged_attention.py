"""Test helpers to drive a vx model step by step through a paged KV cache, as the ModelRunner would.

`PagedRunner` keeps per-request token lists and block tables (block ids drawn from a shuffled pool, so
tables are neither contiguous nor ordered) and builds `CommonAttentionMetadata` for each step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from vx.gpu.attention.backend import AttentionBackend, CommonAttentionMetadata


def make_common_metadata(num_computed: list[int], num_new: list[int], block_tables: list[list[int]],
                         block_size: int, device: str | torch.device = "cpu",
                         num_padding_tokens: int = 0) -> CommonAttentionMetadata:
    """CommonAttentionMetadata for requests that have `num_computed[i]` tokens cached and `num_new[i]` now.

    Tokens are laid out request after request; `num_padding_tokens` extra rows get slot -1.
    """
    num_reqs = len(num_new)
    qsl = [0]
    for n in num_new:
        qsl.append(qsl[-1] + n)
    seq_lens = [c + n for c, n in zip(num_computed, num_new)]
    max_blocks = max(1, max(len(bt) for bt in block_tables))
    table = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
    for i, bt in enumerate(block_tables):
        table[i, : len(bt)] = torch.tensor(bt, dtype=torch.int32)
    slots: list[int] = []
    for c, n, bt in zip(num_computed, num_new, block_tables):
        for pos in range(c, c + n):
            slots.append(bt[pos // block_size] * block_size + pos % block_size)
    slots += [-1] * num_padding_tokens
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl_t.to(device), query_start_loc_cpu=qsl_t,
        seq_lens=seq_t.to(device), seq_lens_cpu=seq_t,
        block_table=table.to(device), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_reqs=num_reqs, num_actual_tokens=qsl[-1], max_query_len=max(num_new, default=0),
        max_seq_len=max(seq_lens, default=0), block_size=block_size)


@dataclass
class _Req:
    tokens: list[int]
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)


class PagedRunner:
    """Runs a vx model step by step over a paged cache (the ModelRunner's job, minus scheduling)."""

    def __init__(self, model: torch.nn.Module, backend: type[AttentionBackend], num_blocks: int,
                 block_size: int, seed: int = 0) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.reqs: dict[str, _Req] = {}
        self.device = next(model.parameters()).device

    def add(self, req_id: str, tokens: list[int]) -> None:
        """Register a request with its known tokens (the prompt; more may be appended later)."""
        self.reqs[req_id] = _Req(list(tokens))

    def append(self, req_id: str, token: int) -> None:
        """Append a token (e.g. a sampled one) to be computed in a later step."""
        self.reqs[req_id].tokens.append(token)

    def step(self, schedule: dict[str, int], num_padding_tokens: int = 0) -> dict[str, torch.Tensor]:
        """Compute `schedule[req]` more tokens of each request in one batch; returns per-request logits
        [n, vocab] for the tokens just computed."""
        ids: list[int] = []
        positions: list[int] = []
        computed, new, tables = [], [], []
        for rid, n in schedule.items():
            r = self.reqs[rid]
            end = r.num_computed + n
            assert end <= len(r.tokens), f"{rid}: scheduling past the known tokens"
            while len(r.blocks) * self.block_size < end:
                r.blocks.append(self.free_blocks.pop())
            ids += r.tokens[r.num_computed:end]
            positions += list(range(r.num_computed, end))
            computed.append(r.num_computed)
            new.append(n)
            tables.append(r.blocks)
        ids += [0] * num_padding_tokens
        positions += [0] * num_padding_tokens
        common = make_common_metadata(computed, new, tables, self.block_size,
                                      device=self.device, num_padding_tokens=num_padding_tokens)
        md = self.backend.build_metadata(common)
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids, device=self.device),
                                torch.tensor(positions, device=self.device), md)
            logits = self.model.compute_logits(hidden[: common.num_actual_tokens])
        out = {}
        for i, rid in enumerate(schedule):
            s, e = int(common.query_start_loc_cpu[i]), int(common.query_start_loc_cpu[i + 1])
            out[rid] = logits[s:e]
            self.reqs[rid].num_computed += schedule[rid]
        return out
