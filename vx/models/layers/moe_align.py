"""Expert-sorted blocks for a grouped GEMM: the (token, slot) assignments of a top-k routing, grouped by expert,
each expert's group padded to a whole number of `block_m` rows, and the expert of every block.

A grouped-GEMM kernel then gives each program one block: all its rows share one expert's weight, so it gathers
those rows and multiplies them by that weight alone. Everything here is torch ops of static shape on the device
(no per-expert count read on the host), so a step can be replayed from a CUDA graph; the price is a grid sized
for the worst case, whose unused blocks carry expert -1 and do nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AlignedBlocks:
    """`sorted_ids` [num_blocks * block_m]: assignment ids (token * top_k + slot), expert by expert, each expert's
    run padded to a multiple of `block_m` with `num_assignments` (no row); `block_expert` [num_blocks]: the expert of
    each block, -1 past the last used block."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    block_m: int
    num_assignments: int


def max_padded_rows(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Rows enough for any routing: each expert that has assignments pads at most block_m - 1 rows, and at most
    min(experts, assignments) of them have any; rounded up to whole blocks."""
    rows = num_assignments + min(num_experts, num_assignments) * (block_m - 1)
    return -(-rows // block_m) * block_m


def align_to_blocks(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedBlocks:
    """Group the assignments of `expert_ids` [T, top_k] (int) by expert into blocks of `block_m` rows.

    Within an expert, assignments keep their id order (a stable sort), so the layout is deterministic.
    """
    if block_m < 1:
        raise ValueError(f"block_m must be positive, got {block_m}.")
    flat = expert_ids.reshape(-1).long()
    n = flat.numel()
    device = flat.device
    rows = max_padded_rows(n, num_experts, block_m)
    # scatter_add rather than bincount: bincount on CUDA reads the largest id on the host to size its output.
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # assignment ids, expert by expert
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(n, device=device) - count_start[sorted_experts]
    sorted_ids = torch.full((rows,), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, padded_start[sorted_experts] + rank_in_expert, order.to(torch.int32))
    # A block's expert is the one whose padded run holds its first row; rows past every run get num_experts -> -1.
    block_starts = torch.arange(0, rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return AlignedBlocks(sorted_ids, block_expert, block_m, n)
