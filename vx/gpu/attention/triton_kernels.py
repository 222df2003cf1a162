"""Triton kernels of the triton attention backend: the KV-cache write and unified paged attention.

Imported only once the triton backend is chosen (see `triton_backend._kernels`), so that the process
decides `TRITON_INTERPRET` before triton sees any kernel. Both kernels address one layer's cache through
a flat per-slot view: slot = physical_block * block_size + offset, row = [num_kv_heads, row width].

A quantized cache (kv_format.py) reaches the attention kernel as its codes: KV_KIND 1 is float8 e4m3 read as uint8
and decoded with integer ops (`fp8_e4m3_to_f32`: the same on every GPU and in the interpreter, which has no
float8 conversion of its own), KV_KIND 2 is int8 with each row's float32 scale read through a float32 view of the
same cache. Keys and values are dequantized to float32, then cast to q's dtype for the dot products.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_k_tok, stride_v_tok, stride_cache_slot,
    ROW: tl.constexpr, ROW_PAD: tl.constexpr,
):
    """One program per token: copy its k and v rows ([num_kv_heads*head_dim]) to its cache slot.

    Slot -1 (padding) stores nothing. The check is a store mask rather than a host-side filter, so a step
    with padding needs no device->host sync and the launch is the same shape every step.
    """
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    offs = tl.arange(0, ROW_PAD)
    # Broadcast the slot before comparing: Triton's interpreter turns `block & scalar` masks into int32.
    mask = (offs < ROW) & ((tl.zeros([ROW_PAD], dtype=tl.int64) + slot) >= 0)
    k = tl.load(k_ptr + tok.to(tl.int64) * stride_k_tok + offs, mask=mask)
    v = tl.load(v_ptr + tok.to(tl.int64) * stride_v_tok + offs, mask=mask)
    tl.store(k_cache_ptr + slot * stride_cache_slot + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * stride_cache_slot + offs, v, mask=mask)


@triton.jit
def fp8_e4m3_to_f32(code):
    """float8 e4m3fn codes (uint8) -> float32: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
    subnormal. Built from a normal power of two, so no float32 subnormal (flushed on some paths) is ever made."""
    b = code.to(tl.int32) & 0xFF
    e = (b >> 3) & 15
    m = b & 7
    mant = tl.where(e == 0, m, m + 8).to(tl.float32)
    pow2 = ((tl.maximum(e, 1) + 117) << 23).to(tl.float32, bitcast=True)  # 2^(max(e, 1) - 10)
    x = mant * pow2
    return tl.where(b >= 128, -x, x)


@triton.jit
def paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr,
    tile_req_ptr, tile_q0_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
    qk_scale, out_scale, window, soft_cap,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_cache_slot, stride_cache_head, stride_bt_req,
    stride_scale_slot, stride_scale_head, scale_offset,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_KIND: tl.constexpr, SOFT_CAP: tl.constexpr,
):
    """Causal attention of up to BLOCK_Q query tokens of one request, for all query heads of one kv head.

    Grid: (num_tiles, num_kv_heads). Tile t covers queries tile_q0[t] .. +BLOCK_Q-1 (indices within
    request tile_req[t]); prefills, prefill chunks and decodes are all just tiles. Rows of the
    [BLOCK_M, HEAD_DIM] query tile are (query, head-in-group) pairs, so GQA heads that share a kv head
    share every K/V load. Query j of a request sits at absolute position seq_len - q_len + j and sees keys
    0..position (and, with a window, only the last `window` of them). K/V are read through the block table
    BLOCK_N positions at a time with an online softmax in float32 (exp2; qk_scale includes log2(e)).
    KV_KIND: 0 the model dtype, 1 float8 e4m3 codes, 2 int8 codes with a float32 scale per row (k/v_scale_ptr: the
    caches as float32, a row's scale at slot * stride_scale_slot + head * stride_scale_head + scale_offset).
    out_scale multiplies the output (a quantized cache's per-tensor V scale; its K scale is inside qk_scale).
    SOFT_CAP (Gemma 2): the scaled scores x become soft_cap * tanh(x / soft_cap) before the softmax; qk_scale then
    holds the scale alone, and log2(e) is applied after the cap.
    """
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    tok_begin = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - tok_begin
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len  # tokens cached before this step

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q0 + offs_m // GROUP_PAD
    head = kv_head * GROUP + offs_m % GROUP_PAD
    row_ok = (q_idx < q_len) & (offs_m % GROUP_PAD < GROUP)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    q_rows = (tok_begin + q_idx).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if KV_KIND == 0:
        q = q.to(k_cache_ptr.dtype.element_ty)
    q_pos = ctx_len + q_idx

    # Keys this tile can see: up to its last query's position; with a window, from its first query's.
    last_q = tl.minimum(q0 + BLOCK_Q, q_len) - 1
    kv_hi = ctx_len + last_q + 1
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(ctx_len + q0 - window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    k_base = k_cache_ptr + kv_head * stride_cache_head
    v_base = v_cache_ptr + kv_head * stride_cache_head
    k_scale_base = k_scale_ptr + kv_head * stride_scale_head + scale_offset
    v_scale_base = v_scale_ptr + kv_head * stride_scale_head + scale_offset
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt_req
    for start_n in range(kv_lo, kv_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_hi
        # Per-key block lookup: any block size works, and a tile may span several blocks.
        phys = tl.load(bt_row + offs_n // KV_BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = phys * KV_BLOCK_SIZE + offs_n % KV_BLOCK_SIZE
        k = tl.load(k_base + slot[None, :] * stride_cache_slot + offs_d[:, None],
                    mask=n_ok[None, :] & d_ok[:, None], other=0)
        if KV_KIND == 1:
            k = fp8_e4m3_to_f32(k).to(q.dtype)
        elif KV_KIND == 2:
            k_row_scale = tl.load(k_scale_base + slot * stride_scale_slot, mask=n_ok, other=0.0)
            k = (k.to(tl.float32) * k_row_scale[None, :]).to(q.dtype)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if SOFT_CAP:
            # tanh(y) = 1 - 2 / (exp(2y) + 1): exact at both ends in float32 (exp overflows to inf -> 1).
            s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0)) * 1.4426950408889634
        visible = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; shift by 0 there to avoid inf - inf.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot[:, None] * stride_cache_slot + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0)
        if KV_KIND == 1:
            v = fp8_e4m3_to_f32(v).to(q.dtype)
        elif KV_KIND == 2:
            v_row_scale = tl.load(v_scale_base + slot * stride_scale_slot, mask=n_ok, other=0.0)
            v = (v.to(tl.float32) * v_row_scale[:, None]).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * out_scale
    tl.store(out_ptr + q_rows[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
