"""moe_align: the top-k assignments grouped by expert into padded blocks, each block one expert's, computed without
reading anything on the host."""

from __future__ import annotations

import pytest
import torch

from vx.models.layers.moe_align import align_to_blocks, max_padded_rows


def _check(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    blocks = align_to_blocks(expert_ids, num_experts, block_m)
    flat = expert_ids.reshape(-1)
    n = flat.numel()
    ids = blocks.sorted_ids.long()
    assert ids.numel() == max_padded_rows(n, num_experts, block_m) == blocks.block_expert.numel() * block_m
    # Every assignment appears once; the rest is padding.
    assert sorted(ids[ids < n].tolist()) == list(range(n))
    assert (ids[ids >= n] == n).all()
    counts = torch.bincount(flat, minlength=num_experts)
    rows = ids.view(-1, block_m)
    used = 0
    for b, expert in enumerate(blocks.block_expert.tolist()):
        real = rows[b][rows[b] < n]
        if expert < 0:
            assert real.numel() == 0, f"block {b} is unused but holds assignments"
            continue
        used += 1
        assert (flat[real] == expert).all(), f"block {b} mixes experts"
        assert real.tolist() == sorted(real.tolist())  # stable within an expert
    # Exactly the padded count of blocks per expert, none for an expert without tokens, in ascending expert order.
    want = [e for e in range(num_experts) for _ in range(-(-int(counts[e]) // block_m))]
    assert [e for e in blocks.block_expert.tolist() if e >= 0] == want
    assert used == len(want)


@pytest.mark.parametrize("tokens,top_k,num_experts,block_m", [(1, 1, 4, 16), (7, 2, 8, 16), (64, 2, 8, 16),
                                                              (64, 2, 4, 32), (33, 8, 128, 16), (5, 3, 6, 1)])
def test_blocks_hold_each_assignment_once_and_one_expert_each(tokens, top_k, num_experts, block_m):
    g = torch.Generator().manual_seed(tokens * 31 + num_experts)
    expert_ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    _check(expert_ids, num_experts, block_m)


def test_experts_without_tokens_get_no_blocks():
    expert_ids = torch.tensor([[5, 2], [2, 5], [5, 7]])  # experts 0, 1, 3, 4, 6 idle
    _check(expert_ids, 8, 4)
    blocks = align_to_blocks(expert_ids, 8, 4)
    assert blocks.block_expert.tolist()[:3] == [2, 5, 7]
    assert blocks.sorted_ids.tolist()[:12] == [1, 2, 6, 6, 0, 3, 4, 6, 5, 6, 6, 6]


def test_reads_nothing_on_the_host(monkeypatch):
    """The shapes come from (tokens, top_k, experts) alone: no count is turned into a Python number."""
    def refuse(*args, **kwargs):
        raise AssertionError("host readback")

    expert_ids = torch.tensor([[1, 3], [3, 0], [1, 2]])
    for name in ("tolist", "item", "__int__", "__index__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    blocks = align_to_blocks(expert_ids, 4, 16)
    monkeypatch.undo()
    _check(expert_ids, 4, 16)
    assert blocks.sorted_ids.numel() == 80  # 6 assignments + 4 experts * 15 padding rows, in blocks of 16
