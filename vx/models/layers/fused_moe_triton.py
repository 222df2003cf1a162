"""The experts of a MoE layer as two grouped GEMMs in Triton: gate|up with SiLU-and-mul, then down with the routing
weights, over expert-sorted blocks of the top-k assignments (moe_align.py), then the sum over each token's top-k.

Each program takes one block of `BLOCK_M` assignment rows, all routed to the same expert, and a `BLOCK_N` slice of
the output features: it gathers the block's input rows (hidden rows by token for gate|up, the activation rows by
assignment for down), multiplies them by that expert's weight slice, and scatters its results back to the
assignments' rows. The first call keeps two accumulators (gate columns n, up columns n + I) and writes
silu(gate) * up, so the [T*k, 2I] gate|up product never reaches memory; the second scales each row by its routing
weight. No count is read on the host and every launch has a shape fixed by (tokens, top_k, experts): a step can be
captured in a CUDA graph.

Imported only when the path is taken (see fused_moe.py), so that a process decides `TRITON_INTERPRET` before triton
is imported. Runs on CUDA, or on CPU tensors under Triton's interpreter (tests); float32 products are IEEE (no TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vx.models.layers.moe_align import align_to_blocks

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def moe_grouped_gemm_kernel(
    a_ptr, w_ptr, c_ptr, sorted_ids_ptr, block_expert_ptr, topk_weights_ptr,
    num_assignments, N, K,
    stride_am, stride_we, stride_wn, stride_wk, stride_cm,
    IDS_PER_A_ROW: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """c[id, n] = (a[id // IDS_PER_A_ROW] @ w[expert].T)[n] for the block's assignment ids; GATED: w holds 2N rows
    (gate then up) and c gets silu(gate) * up; WEIGHTED: times topk_weights[id]. Padding ids (>= num_assignments)
    read zeros and store nothing; a block of expert -1 returns at once."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    row_ok = ids < num_assignments
    a_rows = tl.where(row_ok, ids // IDS_PER_A_ROW, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    # The weight tile is read transposed, [BLOCK_K, BLOCK_N], from the [N, K] (row-major) expert matrix.
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        acc += tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), input_precision=DOT_PRECISION)
        if GATED:
            w_up = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0)
            acc_up += tl.dot(a, w_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if WEIGHTED:
        acc = acc * tl.load(topk_weights_ptr + ids, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + ids[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _tile(size: int, cap: int) -> int:
    """A power-of-two tile for a dimension of `size`: at least 16 (tl.dot's minimum), at most `cap`."""
    return max(16, min(cap, triton.next_power_of_2(size)))


def block_m_for(num_assignments: int, num_experts: int) -> int:
    """Rows per block: about the rows an expert gets on average, so that few-token steps (decode) pad little."""
    return _tile(-(-num_assignments // num_experts), 64)


def _launch(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, blocks, topk_weights: torch.Tensor,
            ids_per_a_row: int, gated: bool) -> None:
    n, k = out.shape[1], a.shape[1]
    block_n = _tile(n, 64)
    block_k = _tile(k, 32 if a.dtype == torch.float32 else 64)
    num_blocks = blocks.block_expert.numel()
    grid = (num_blocks, triton.cdiv(n, block_n))
    moe_grouped_gemm_kernel[grid](
        a, w, out, blocks.sorted_ids, blocks.block_expert, topk_weights,
        blocks.num_assignments, n, k,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        IDS_PER_A_ROW=ids_per_a_row, GATED=gated, WEIGHTED=not gated,
        BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )


def fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t, j], for hidden [T, H],
    w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]; returns [T, H] in the hidden states' dtype."""
    dtype = hidden_states.dtype
    if dtype not in SUPPORTED_DTYPES or w13.dtype != dtype or w2.dtype != dtype:
        raise ValueError(f"triton fused MoE needs float32/bfloat16/float16 hidden states and weights of the same "
                         f"dtype, got {dtype}, {w13.dtype}, {w2.dtype}.")
    if dtype == torch.bfloat16 and hidden_states.device.type == "cpu":
        # Triton 3.9's interpreter multiplies bf16 tiles as raw integers: refuse instead of returning garbage.
        raise ValueError("triton fused MoE under TRITON_INTERPRET=1 supports float32/float16 only; "
                         "bfloat16 needs CUDA.")
    num_tokens, hidden = hidden_states.shape
    num_experts, two_i, _ = w13.shape
    if w13.shape[2] != hidden or w2.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(f"expert weights {tuple(w13.shape)} / {tuple(w2.shape)} do not fit hidden size {hidden}.")
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(hidden_states)
    n = num_tokens * top_k
    blocks = align_to_blocks(topk_ids, num_experts, block_m_for(n, num_experts))
    weights = topk_weights.reshape(-1).to(torch.float32)
    x = hidden_states.contiguous()
    act = torch.empty(n, two_i // 2, dtype=dtype, device=x.device)
    _launch(x, w13, act, blocks, weights, top_k, gated=True)
    per_assignment = torch.empty(n, hidden, dtype=dtype, device=x.device)
    _launch(act, w2, per_assignment, blocks, weights, 1, gated=False)
    return per_assignment.view(num_tokens, top_k, hidden).sum(dim=1)
