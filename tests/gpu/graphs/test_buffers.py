"""Decode-graph sizes and buffers (vx.gpu.graphs.buffers): which sizes get a graph, which one a step runs, and the
padding rows and reuse of the persistent inputs."""

from __future__ import annotations

import pytest
import torch

from vx.gpu.graphs.buffers import PADDING_SLOT, DecodeBuffers, bucket_for, capture_sizes


def test_capture_sizes_cover_max_num_seqs():
    assert capture_sizes(64, "cpu") == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(48, "cpu") == [1, 2, 4, 8, 16, 32, 48]
    assert capture_sizes(1, "cpu") == [1]
    assert capture_sizes(40, "cuda") == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_sizes(3, "cuda") == [1, 2, 3]
    with pytest.raises(ValueError):
        capture_sizes(0, "cpu")


def test_bucket_is_the_smallest_size_that_holds_the_batch():
    sizes = [1, 2, 4, 8]
    assert [bucket_for(sizes, n) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert bucket_for(sizes, 9) is None


def test_buffers_pad_rows_past_the_batch_and_are_reused():
    buffers = DecodeBuffers.allocate(8, 6, torch.device("cpu"))
    pointers = [t.data_ptr() for t in (buffers.input_ids, buffers.slot_mapping, buffers.block_table)]
    for n, size in ((3, 4), (1, 1), (5, 8)):
        ids = torch.arange(10, 10 + n)
        block_table = torch.arange(1, 1 + 2 * n, dtype=torch.int32).view(n, 2)
        buffers.fill(ids, ids + 100, [ids + 1000], [block_table], torch.full((n,), 17, dtype=torch.int32), size)
        md = buffers.metadata(size)
        assert md.slot_mapping.shape == (size,) and md.block_table.shape == (size, 6)
        assert buffers.input_ids[:n].tolist() == ids.tolist()
        assert md.slot_mapping[:n].tolist() == (ids + 1000).tolist()
        assert md.block_table[:n, :2].tolist() == block_table.tolist()
        # Padding rows: token 0 at position 0, writing and reading the null block's first slot only.
        assert md.slot_mapping[n:].tolist() == [PADDING_SLOT] * (size - n)
        assert md.seq_lens[n:].tolist() == [1] * (size - n)
        assert md.block_table[n:, 0].tolist() == [0] * (size - n)
        assert buffers.input_ids[n:size].tolist() == [0] * (size - n)
        assert buffers.positions[n:size].tolist() == [0] * (size - n)
    assert [t.data_ptr() for t in (buffers.input_ids, buffers.slot_mapping, buffers.block_table)] == pointers
