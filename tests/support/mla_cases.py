"""Steps of multi-head latent attention for backend tests: a batch of requests over a paged latent cache, and the
dense reference (every head's keys and values expanded in float64, plain causal softmax).

A case is like `attention_cases.make_case`'s: each request has `computed` latent rows already cached and `new` rows
this step, on shuffled block tables, plus padding rows (slot -1) whose rows must never reach the cache.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import nn

from tests.support.paged_attention import make_common_metadata
from vx.gpu.attention.backend import CommonAttentionMetadata
from vx.models.layers.mla import MLAAttention


@dataclass
class MLACase:
    common: CommonAttentionMetadata
    layer: MLAAttention
    q: torch.Tensor          # [T, heads, nope + rope]
    rows: torch.Tensor       # [T, rank + rope]: the step's latent rows (padding rows 99)
    cache: torch.Tensor      # [num_blocks, block_size, 1, rank + rope], the cached prefixes written
    context: list[torch.Tensor]  # per request: all its rows [seq_len, rank + rope], cached then new


def make_mla_case(computed: list[int], new: list[int], heads: int = 4, rank: int = 32, rope: int = 16,
                  nope: int = 16, v_dim: int = 16, block_size: int = 4, dtype: torch.dtype = torch.float32,
                  device: str = "cpu", pad: int = 3, seed: int = 0) -> MLACase:
    """Random queries, latent rows and up-projection (unit-scale scores, so the softmax is neither flat nor one-hot)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(c + n) // block_size) for c, n in zip(computed, new)]
    num_blocks = sum(blocks_needed) + 3
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)
    tables = [[pool.pop() for _ in range(nb)] for nb in blocks_needed]
    row = rank + rope
    cache = torch.zeros(num_blocks, block_size, 1, row, dtype=dtype)
    flat = cache.view(-1, row)
    common = make_common_metadata(computed, new, tables, block_size, device=device, num_padding_tokens=pad)
    n = common.num_actual_tokens
    q = torch.randn(n + pad, heads, nope + rope, generator=gen).to(dtype)
    rows = torch.randn(n + pad, row, generator=gen).to(dtype)
    rows[n:] = 99.0
    context = []
    start = 0
    for c, k, bt in zip(computed, new, tables):
        prefix = torch.randn(c, row, generator=gen).to(dtype)
        flat[[bt[p // block_size] * block_size + p % block_size for p in range(c)]] = prefix
        context.append(torch.cat((prefix, rows[start:start + k])))
        start += k
    kv_b_proj = nn.Linear(rank, heads * (nope + v_dim), bias=False)
    with torch.no_grad():
        kv_b_proj.weight.copy_(torch.randn(kv_b_proj.weight.shape, generator=gen) * rank ** -0.5)
    kv_b_proj = kv_b_proj.to(device=device, dtype=dtype).requires_grad_(False)
    layer = MLAAttention(heads, rank, nope, rope, v_dim, (nope + rope) ** -0.5, kv_b_proj)
    return MLACase(common, layer, q.to(device), rows.to(device), cache.to(device), [c.to(device) for c in context])


def mla_reference(case: MLACase) -> torch.Tensor:
    """The actual rows' outputs [num_actual_tokens, heads * v_dim] in float64, from the expanded keys and values."""
    layer = case.layer
    w = layer.kv_b_proj.weight.double().view(layer.num_heads, layer.qk_nope_head_dim + layer.v_head_dim, -1)
    w_uk, w_uv = w[:, :layer.qk_nope_head_dim], w[:, layer.qk_nope_head_dim:]
    qsl = case.common.query_start_loc_cpu.tolist()
    outs = []
    for r, ctx in enumerate(case.context):
        ctx = ctx.double()
        latent, rope = ctx[:, :layer.kv_lora_rank], ctx[:, layer.kv_lora_rank:]
        keys = torch.cat((torch.einsum("hdr,lr->hld", w_uk, latent),
                          rope[None].expand(layer.num_heads, -1, -1)), dim=-1)
        values = torch.einsum("hvr,lr->hlv", w_uv, latent)
        q = case.q[qsl[r]:qsl[r + 1]].double().transpose(0, 1)  # [heads, q_len, d]
        q_len, seq_len = q.shape[1], ctx.shape[0]
        scores = q @ keys.transpose(1, 2) * layer.scale
        visible = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
        probs = torch.softmax(scores.masked_fill(~visible.to(scores.device), float("-inf")), dim=-1)
        outs.append((probs @ values).transpose(0, 1).reshape(q_len, -1))
    return torch.cat(outs)
