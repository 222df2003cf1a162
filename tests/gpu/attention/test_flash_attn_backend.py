"""FlashAttention-2 backend: its gather metadata on CPU; equality with the torch backend on CUDA (`gpu`)."""

from __future__ import annotations

import pytest
import torch

from tests.support.attention_cases import compare, make_case
from tests.support.paged_attention import make_common_metadata
from vx.gpu.attention import get_attn_backend
from vx.gpu.attention.flash_attn_backend import FlashAttnBackend
from vx.gpu.attention.torch_backend import TorchAttentionBackend


def test_gather_metadata_below_256_token_blocks():
    """Blocks of 4 are not FA2-pageable: every context position's slot is listed, request by request."""
    tables = [[5, 2], [7], [0, 3, 1]]
    common = make_common_metadata([3, 0, 8], [2, 3, 1], tables, 4, num_padding_tokens=2)
    md = FlashAttnBackend.build_metadata(common)
    assert not md.paged and md.max_seq_len == 9
    assert md.cu_seqlens_k.tolist() == [0, 5, 8, 17]
    assert md.cu_seqlens_q.tolist() == [0, 2, 5, 6]
    expected = [bt[p // 4] * 4 + p % 4 for bt, n in zip(tables, (5, 3, 9)) for p in range(n)]
    assert md.ctx_slots.tolist() == expected
    assert md.kv_write.rows is None and md.kv_write.slots.tolist() == [23, 8, 28, 29, 30, 4]


def test_constraints():
    assert FlashAttnBackend.is_paged(256) and FlashAttnBackend.is_paged(512) and not FlashAttnBackend.is_paged(16)
    assert "float16/bfloat16" in FlashAttnBackend.unsupported_reason(dtype=torch.float32)
    assert "multiple of 8" in FlashAttnBackend.unsupported_reason(head_dim=36)
    assert FlashAttnBackend.unsupported_reason(dtype=torch.bfloat16, head_dim=128, block_size=16) is None
    assert FlashAttnBackend.get_kv_cache_shape(3, 256, 2, 64) == (2, 3, 256, 2, 64)


SHAPES = {
    "mixed": ([0, 0, 150, 37, 300, 500, 64], [200, 33, 1, 1, 64, 1, 96]),
    "decodes": ([17, 255, 256, 511, 1000, 3], [1, 1, 1, 1, 1, 1]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("block_size", [16, 256])  # gathered context / FA2's own paged path
@pytest.mark.parametrize("heads,head_dim,window", [((32, 8), 128, None), ((16, 16), 64, None),
                                                   ((12, 2), 64, 100)])
def test_flash_attn_matches_torch_on_cuda(shape, block_size, heads, head_dim, window):
    pytest.importorskip("flash_attn")
    assert get_attn_backend("flash_attn", "cuda", dtype=torch.bfloat16, head_dim=head_dim) is FlashAttnBackend
    computed, new = SHAPES[shape]
    case = make_case(computed, new, heads, head_dim, block_size, dtype=torch.bfloat16, device="cuda",
                     window=window, pad=5)
    if block_size == 16:
        assert not FlashAttnBackend.build_metadata(case.common).paged
    err = compare(FlashAttnBackend, TorchAttentionBackend, case)
    assert err <= 3e-2, err
