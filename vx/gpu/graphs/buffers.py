"""Which padded batch sizes get a decode graph, and the persistent input buffers every graph reads.

A step of n requests runs the smallest graph of at least n rows; the rows past n are padding: token 0 at
position 0, writing its k/v into the null block's first slot (block 0 is never handed out) and attending to that
one slot, and their hidden states are cut off before the LM head, so they never sample. A step copies its rows
into the buffers and the graph reads views of them, which is what a CUDA graph needs and costs the CPU nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vx.gpu.attention.backend import DecodeGraphMetadata

PADDING_SLOT = 0  # the null block's first slot: padding rows write there and attend to it alone


def capture_sizes(max_num_seqs: int, device_type: str) -> list[int]:
    """The padded batch sizes that get a graph, ascending, the last one covering `max_num_seqs`.

    CUDA: 1, 2, 4, then steps of 8 (vLLM's choice; a graph is cheap to capture). CPU: powers of two, since each
    size costs a compile of tens of seconds and a padded row costs a CPU little (decode matmuls are bound by
    reading the weights, not by rows).
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}.")
    if device_type == "cuda":
        sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    else:
        sizes = [1 << i for i in range(max_num_seqs.bit_length()) if (1 << i) < max_num_seqs]
    return sizes + [max_num_seqs]


def bucket_for(sizes: list[int], num_reqs: int) -> int | None:
    """The smallest size holding `num_reqs` rows, or None when none does."""
    for size in sizes:
        if size >= num_reqs:
            return size
    return None


@dataclass
class DecodeBuffers:
    """The graphs' inputs, allocated once for the largest size; a graph of size b reads the first b rows. A model
    whose layers use several KV-cache groups (one per attention kind) has a slot mapping and a block table per
    group; `slot_mapping` and `block_table` are the first group's."""

    input_ids: torch.Tensor    # int64 [max]
    positions: torch.Tensor    # int64 [max]
    slot_mappings: list[torch.Tensor]  # int64 [max], one per group
    block_tables: list[torch.Tensor]  # int32 [max, max_blocks_per_seq], one per group
    seq_lens: torch.Tensor     # int32 [max]

    @classmethod
    def allocate(cls, max_size: int, max_blocks_per_seq: int, device: torch.device, num_groups: int = 1,
                 ) -> DecodeBuffers:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        buffers = cls(zeros(max_size, dtype=torch.int64), zeros(max_size, dtype=torch.int64),
                      [zeros(max_size, dtype=torch.int64) for _ in range(num_groups)],
                      [zeros(max_size, max_blocks_per_seq, dtype=torch.int32) for _ in range(num_groups)],
                      zeros(max_size, dtype=torch.int32))
        buffers.pad(0, max_size)
        return buffers

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.slot_mappings[0]

    @property
    def block_table(self) -> torch.Tensor:
        return self.block_tables[0]

    def pad(self, start: int, stop: int) -> None:
        """Make rows [start, stop) padding rows."""
        self.input_ids[start:stop] = 0
        self.positions[start:stop] = 0
        for slot_mapping, block_table in zip(self.slot_mappings, self.block_tables):
            slot_mapping[start:stop] = PADDING_SLOT
            block_table[start:stop, 0] = 0
        self.seq_lens[start:stop] = 1

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mappings: Sequence[torch.Tensor],
             block_tables: Sequence[torch.Tensor], seq_lens: torch.Tensor, size: int) -> None:
        """Rows [0, n) from one decode step's inputs (n requests, one token each; a slot mapping and a block
        table per group), rows [n, size) padding."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        for own, new in zip(self.slot_mappings, slot_mappings):
            own[:n].copy_(new)
        # Entries past a row's own blocks keep older values: the kernel reads only the blocks its length needs.
        for own, new in zip(self.block_tables, block_tables):
            own[:n, :new.shape[1]].copy_(new)
        self.seq_lens[:n].copy_(seq_lens)
        self.pad(n, size)

    def metadata(self, size: int) -> DecodeGraphMetadata | list[DecodeGraphMetadata]:
        """The attention inputs of a graph of `size`: one per group, as a list when there are several (each layer
        reads its group's)."""
        per_group = [DecodeGraphMetadata(slot_mapping=slot_mapping[:size], block_table=block_table[:size],
                                         seq_lens=self.seq_lens[:size])
                     for slot_mapping, block_table in zip(self.slot_mappings, self.block_tables)]
        return per_group[0] if len(per_group) == 1 else per_group
