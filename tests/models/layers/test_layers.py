"""Layer building blocks: TP-sharded weight loaders, fused norm, activation, the unbound Attention error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vx.models.layers import (Attention, ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                              ReplicatedLinear, RMSNorm, RowParallelLinear, SiluAndMul, VocabParallelEmbedding)


def _load(layer, name, full, shard_id=None):
    p = getattr(layer, name)
    if shard_id is None:
        p.weight_loader(p, full)
    else:
        p.weight_loader(p, full, shard_id)


@pytest.mark.parametrize("rank", [0, 1])
def test_column_and_row_take_their_shard(rank):
    w = torch.randn(8, 6)
    col = ColumnParallelLinear(6, 8, bias=True, tp_size=2, tp_rank=rank)
    _load(col, "weight", w)
    _load(col, "bias", torch.arange(8.0))
    assert torch.equal(col.weight, w[rank * 4:(rank + 1) * 4])
    assert torch.equal(col.bias, torch.arange(8.0)[rank * 4:(rank + 1) * 4])
    row = RowParallelLinear(6, 8, bias=True, tp_size=2, tp_rank=rank)
    _load(row, "weight", w)
    _load(row, "bias", torch.arange(8.0))
    assert torch.equal(row.weight, w[:, rank * 3:(rank + 1) * 3]) and torch.equal(row.bias, torch.arange(8.0))


@pytest.mark.parametrize("rank", [0, 1])
def test_merged_and_qkv_place_shards(rank):
    gate, up = torch.randn(10, 4), torch.randn(10, 4)
    merged = MergedColumnParallelLinear(4, [10, 10], tp_size=2, tp_rank=rank)
    _load(merged, "weight", gate, 0)
    _load(merged, "weight", up, 1)
    assert torch.equal(merged.weight, torch.cat([gate[rank * 5:(rank + 1) * 5], up[rank * 5:(rank + 1) * 5]]))
    # 4 heads, 1 kv head, TP 2: the kv head is replicated on both ranks.
    hd = 2
    q, k, v = torch.randn(4 * hd, 8), torch.randn(hd, 8), torch.randn(hd, 8)
    qkv = QKVParallelLinear(8, hd, 4, 1, bias=False, tp_size=2, tp_rank=rank)
    assert (qkv.num_heads, qkv.num_kv_heads, qkv.q_size, qkv.kv_size) == (2, 1, 4, 2)
    for sid, t in zip("qkv", (q, k, v)):
        _load(qkv, "weight", t, sid)
    assert torch.equal(qkv.weight, torch.cat([q[rank * 4:(rank + 1) * 4], k, v]))
    with pytest.raises(ValueError, match="shard_id"):
        _load(qkv, "weight", q, "x")


def test_tp1_layers_compute_plain_linear():
    x = torch.randn(3, 6)
    rep = ReplicatedLinear(6, 5, bias=True)
    w, b = torch.randn(5, 6), torch.randn(5)
    _load(rep, "weight", w)
    _load(rep, "bias", b)
    torch.testing.assert_close(rep(x), F.linear(x, w, b))
    emb = VocabParallelEmbedding(10, 6)
    table = torch.randn(10, 6)
    _load(emb, "weight", table)
    assert torch.equal(emb(torch.tensor([3, 0, 9])), table[[3, 0, 9]])


def test_rmsnorm_fused_residual_matches_separate_ops():
    norm = RMSNorm(16, eps=1e-6)
    norm.weight.data = torch.randn(16)
    x, res = torch.randn(4, 16), torch.randn(4, 16)
    plain = norm(x + res)
    fused, new_res = norm(x, res)
    torch.testing.assert_close(fused, plain, atol=0, rtol=0)
    torch.testing.assert_close(new_res, x + res)
    ref = norm.weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(norm(x), ref)
    assert norm(x.bfloat16()).dtype == torch.float32  # weight (fp32) * normed (bf16) promotes, as in HF


def test_silu_and_mul():
    x = torch.randn(3, 8)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :4]) * x[:, 4:])


def test_unbound_attention_raises_clearly():
    attn = Attention(4, 8, 8 ** -0.5, 2, layer_idx=3)
    with pytest.raises(RuntimeError, match="layer 3.*bind_kv_caches"):
        attn(torch.randn(2, 32), torch.randn(2, 16), torch.randn(2, 16), None)
    with pytest.raises(ValueError, match="multiple"):
        Attention(4, 8, 1.0, 3)
