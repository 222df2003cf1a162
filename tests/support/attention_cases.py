"""Shared builder for backend-vs-backend attention checks (CPU interpreter runs and CUDA runs alike).

A case is a batch of requests, each with `computed` tokens already in the cache and `new` tokens this
step, on shuffled (non-contiguous) block tables, plus padding rows with slot -1. `run_backend` runs one
backend's write + attention on a fresh copy of the prefilled cache, so backends can be compared exactly.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from tests.support.paged_attention import make_common_metadata
from vx.gpu.attention.backend import AttentionBackend, CommonAttentionMetadata


@dataclass
class AttnCase:
    """Inputs of one attention step and the prefilled cache every backend starts from."""

    common: CommonAttentionMetadata
    q: torch.Tensor          # [T, H*D] (T includes padding rows)
    k: torch.Tensor          # [T, Hk*D]
    v: torch.Tensor
    cache: torch.Tensor      # [2, num_blocks, block_size, Hk, D], the cached prefixes already written
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None


def make_case(computed: list[int], new: list[int], heads: tuple[int, int], head_dim: int, block_size: int,
              dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", window: int | None = None,
              pad: int = 3, seed: int = 0) -> AttnCase:
    """Random q/k/v and a cache holding each request's first `computed` tokens; tables are shuffled."""
    h, hk = heads
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(c + n) // block_size) for c, n in zip(computed, new)]
    num_blocks = sum(blocks_needed) + 3
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)
    tables = [[pool.pop() for _ in range(nb)] for nb in blocks_needed]
    cache = torch.zeros(2, num_blocks, block_size, hk, head_dim, dtype=dtype)
    flat = cache.view(2, -1, hk, head_dim)
    for c, bt in zip(computed, tables):
        slots = [bt[p // block_size] * block_size + p % block_size for p in range(c)]
        flat[:, slots] = torch.randn(2, c, hk, head_dim, generator=gen).to(dtype)
    common = make_common_metadata(computed, new, tables, block_size, device=device, num_padding_tokens=pad)
    t = common.num_actual_tokens + pad
    q = torch.randn(t, h * head_dim, generator=gen).to(dtype)
    k = torch.randn(t, hk * head_dim, generator=gen).to(dtype)
    v = torch.randn(t, hk * head_dim, generator=gen).to(dtype)
    k[common.num_actual_tokens:] = 99.0  # padding rows must never reach the cache
    v[common.num_actual_tokens:] = 99.0
    return AttnCase(common, q.to(device), k.to(device), v.to(device), cache.to(device), h, hk, head_dim,
                    window)


def run_backend(backend: type[AttentionBackend], case: AttnCase) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [T, H*D], cache after the step) of `backend` on a copy of the case's cache."""
    cache = case.cache.clone()
    impl = backend.get_impl_cls()(case.num_heads, case.head_dim, 1 / math.sqrt(case.head_dim),
                                  case.num_kv_heads, sliding_window=case.window)
    md = backend.build_metadata(case.common)
    out = impl.forward(None, case.q, case.k, case.v, cache, md)
    return out, cache


def compare(backend: type[AttentionBackend], reference: type[AttentionBackend], case: AttnCase) -> float:
    """Max abs difference of the outputs (real rows); asserts caches and padding rows behave the same."""
    out, cache = run_backend(backend, case)
    ref_out, ref_cache = run_backend(reference, case)
    n = case.common.num_actual_tokens
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    assert torch.equal(cache, ref_cache), "KV caches differ after the write"
    assert not (cache == 99.0).any(), "padding tokens must not be written"
    assert torch.all(out[n:] == 0), "padding rows must be zero"
    assert torch.isfinite(out[:n]).all()
    return float((out[:n].float() - ref_out[:n].float()).abs().max()) if n else 0.0
