"""Triton decode kernel of the MLA backend: absorbed attention straight from the paged latent cache.

Imported only when the MLA backend decodes with Triton (see `mla_backend._triton_kernels`), so that a process decides
`TRITON_INTERPRET` before triton sees the kernel. The cache is one layer's [num_blocks, block_size, 1, row] tensor,
row = kv_lora_rank latent values then qk_rope_head_dim rotary key values; the kernel reads it in place through each
request's block table, never expanding it to per-head keys and values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Query heads one program attends together: tl.dot needs at least 16 rows, and a tile of heads shares every latent
# row it loads (all heads read the same cache row, MQA-like).
BLOCK_H = 16


@triton.jit
def mla_decode_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, out_ptr, block_table_ptr, seq_lens_ptr,
    qk_scale,
    stride_ql_req, stride_ql_head, stride_qp_req, stride_qp_head, stride_o_req, stride_o_head,
    stride_slot, stride_bt_req,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, RANK: tl.constexpr, RANK_PAD: tl.constexpr,
    ROPE: tl.constexpr, ROPE_PAD: tl.constexpr, BLOCK_N: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One decode request's single query, BLOCK_H of its heads, over its seq_len cached latent rows.

    Grid: (num_requests, cdiv(NUM_HEADS, BLOCK_H)). score(h, n) = q_lat[h] . latent[n] + q_pe[h] . rope[n] (q_lat is
    q_nope folded through W_UK); the output is the softmax-weighted sum of the latent rows, [heads, RANK], which the
    caller multiplies by W_UV. Online softmax in float32 with exp2 (qk_scale includes log2(e)).
    """
    req = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < NUM_HEADS
    offs_r = tl.arange(0, RANK_PAD)
    r_ok = offs_r < RANK
    offs_p = tl.arange(0, ROPE_PAD)
    p_ok = offs_p < ROPE
    q_lat = tl.load(q_lat_ptr + req.to(tl.int64) * stride_ql_req + heads[:, None] * stride_ql_head + offs_r[None, :],
                    mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + req.to(tl.int64) * stride_qp_req + heads[:, None] * stride_qp_head + offs_p[None, :],
                   mask=h_ok[:, None] & p_ok[None, :], other=0.0)
    q_lat = q_lat.to(cache_ptr.dtype.element_ty)
    q_pe = q_pe.to(cache_ptr.dtype.element_ty)
    seq_len = tl.load(seq_lens_ptr + req)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt_req

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], dtype=tl.float32)
    for start_n in range(0, seq_len, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < seq_len
        phys = tl.load(bt_row + offs_n // KV_BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        row = cache_ptr + (phys * KV_BLOCK_SIZE + offs_n % KV_BLOCK_SIZE) * stride_slot
        latent = tl.load(row[:, None] + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        rope = tl.load(row[:, None] + RANK + offs_p[None, :], mask=n_ok[:, None] & p_ok[None, :], other=0.0)
        s = tl.dot(q_lat, tl.trans(latent), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, tl.trans(rope), input_precision=DOT_PRECISION)
        s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))
        # seq_len >= 1, so the first tile has a visible key in every row and m_new is finite from there on.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + req.to(tl.int64) * stride_o_req + heads[:, None] * stride_o_head + offs_r[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & r_ok[None, :])


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def mla_decode_triton(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Absorbed MLA decode from the paged latent cache: the softmax-weighted latent rows [B, heads, kv_lora_rank].

    q_lat [B, heads, kv_lora_rank], q_pe [B, heads, qk_rope_head_dim] (rotated); kv_cache [num_blocks, block_size,
    1, kv_lora_rank + qk_rope_head_dim]; request b reads positions 0..seq_lens[b]-1 through block_table[b].
    """
    num_reqs, num_heads, rank = q_lat.shape
    rope = q_pe.shape[-1]
    block_size, row = kv_cache.shape[1], kv_cache.shape[-1]
    if row != rank + rope:
        raise ValueError(f"MLA cache rows hold {row} values, expected kv_lora_rank {rank} + rope {rope}.")
    if not kv_cache.is_contiguous():
        raise ValueError("the MLA decode kernel addresses the cache by slot: it must be contiguous.")
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    block_table = block_table.contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty(num_reqs, num_heads, rank, dtype=q_lat.dtype, device=q_lat.device)
    if num_reqs == 0:
        return out
    rank_pad = max(16, _next_pow2(rank))
    # A [BLOCK_N, rank] latent tile per step: keep it (and its pipelined copies) well inside shared memory.
    block_n = 16 if rank_pad * kv_cache.element_size() > 1024 else 32
    grid = (num_reqs, triton.cdiv(num_heads, BLOCK_H))
    mla_decode_kernel[grid](
        q_lat, q_pe, kv_cache, out, block_table, seq_lens,
        scale * 1.4426950408889634,  # log2(e): the kernel's softmax uses exp2
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(1), block_table.stride(0),
        NUM_HEADS=num_heads, BLOCK_H=BLOCK_H, RANK=rank, RANK_PAD=rank_pad, ROPE=rope,
        ROPE_PAD=max(16, _next_pow2(rope)), BLOCK_N=block_n, KV_BLOCK_SIZE=block_size,
        DOT_PRECISION="ieee" if kv_cache.dtype == torch.float32 else "tf32",
        num_warps=4 if rank_pad <= 128 else 8)
    return out
