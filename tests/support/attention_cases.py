"""Shared builder for backend-vs-backend attention checks (CPU interpreter runs and CUDA runs alike).

A case is a batch of requests, each with `computed` tokens already in the cache and `new` tokens this
step, on shuffled (non-contiguous) block tables, plus padding rows with slot -1. `run_backend` runs one
backend's write + attention on a fresh copy of the prefilled cache, so backends can be compared exactly.
A case may hold its cache in a quantized `kv_cache_dtype`; `dequantized(case)` is the same step on a float cache
holding what the quantized one gives back (the exact reference of a quantized backend), and `float_case(case)` the
same step on the float data before quantization (what quantization is measured against).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from tests.support.paged_attention import make_common_metadata
from vx.gpu.attention.backend import AttentionBackend, CommonAttentionMetadata, as_bytes
from vx.gpu.attention.kv_format import kv_cache_format


# How far a quantized cache may move an attention output from the float cache's, on make_case's unit-normal data.
# Rounding V alone moves an output by up to eps * max|v|, with |v| <= ~4.5 here: fp8 e4m3 rounds to 3 mantissa bits
# (eps = 2^-4 relative: up to 0.28), int8 to half a step of its row's absmax / 127 (up to 0.018); rounding K adds a
# smaller softmax term. Measured maxima over the attention tests' cases: 0.14 (fp8), 0.024 (int8).
FLOAT_CACHE_TOL = {"fp8_e4m3": 0.25, "int8": 0.05}
# A quantized backend against attention over what its cache gives back, computed on a float cache: only the order
# of float32 sums differs (measured <= 1e-6).
EXACT_TOL = 1e-5


@dataclass
class AttnCase:
    """Inputs of one attention step and the prefilled cache every backend starts from."""

    common: CommonAttentionMetadata
    q: torch.Tensor          # [T, H*D] (T includes padding rows)
    k: torch.Tensor          # [T, Hk*D]
    v: torch.Tensor
    cache: torch.Tensor      # [2, num_blocks, block_size, Hk, row], the cached prefixes already written
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None
    kv_cache_dtype: str = "auto"
    float_cache: torch.Tensor | None = None  # a quantized case's cache before quantization
    soft_cap: float | None = None  # Gemma 2's attention-logit soft cap, when the case has one


def make_case(computed: list[int], new: list[int], heads: tuple[int, int], head_dim: int, block_size: int,
              dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", window: int | None = None,
              pad: int = 3, seed: int = 0, kv_cache_dtype: str = "auto", soft_cap: float | None = None) -> AttnCase:
    """Random q/k/v and a cache holding each request's first `computed` tokens; tables are shuffled.

    The data do not depend on `kv_cache_dtype`: it only says how the cache stores them.
    """
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
    case = AttnCase(common, q.to(device), k.to(device), v.to(device), cache.to(device), h, hk, head_dim, window,
                    soft_cap=soft_cap)
    fmt = kv_cache_format(kv_cache_dtype)
    if fmt.quantized:
        case.kv_cache_dtype, case.float_cache = kv_cache_dtype, case.cache
        case.cache = fmt.store(case.cache, fmt.cache_dtype(dtype))
    return case


def dequantized(case: AttnCase) -> AttnCase:
    """The float case of what a quantized case's cache gives back: its cache and new k/v after a round trip."""
    fmt = kv_cache_format(case.kv_cache_dtype)
    dtype = case.q.dtype

    def round_trip(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(x.shape[0], case.num_kv_heads, case.head_dim)
        return fmt.load(fmt.store(rows, fmt.cache_dtype(dtype)), dtype).reshape(x.shape)

    return AttnCase(case.common, case.q, round_trip(case.k), round_trip(case.v), fmt.load(case.cache, dtype),
                    case.num_heads, case.num_kv_heads, case.head_dim, case.window)


def float_case(case: AttnCase) -> AttnCase:
    """The same step over the float data a quantized case stored (its unquantized reference)."""
    assert case.float_cache is not None, "not a quantized case"
    return AttnCase(case.common, case.q, case.k, case.v, case.float_cache, case.num_heads, case.num_kv_heads,
                    case.head_dim, case.window)


def run_backend(backend: type[AttentionBackend], case: AttnCase) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [T, H*D], cache after the step) of `backend` on a copy of the case's cache."""
    cache = case.cache.clone()
    impl = backend.get_impl_cls()(case.num_heads, case.head_dim, 1 / math.sqrt(case.head_dim),
                                  case.num_kv_heads, sliding_window=case.window, kv_cache_dtype=case.kv_cache_dtype,
                                  logits_soft_cap=case.soft_cap)
    md = backend.build_metadata(case.common)
    out = impl.forward(None, case.q, case.k, case.v, cache, md)
    return out, cache


def compare(backend: type[AttentionBackend], reference: type[AttentionBackend], case: AttnCase) -> float:
    """Max abs difference of the outputs (real rows); asserts caches and padding rows behave the same.

    On a quantized case both backends must write the same bytes (a quantized cache is written through
    `KVCacheFormat.store` by every backend).
    """
    out, cache = run_backend(backend, case)
    ref_out, ref_cache = run_backend(reference, case)
    assert torch.equal(as_bytes(cache), as_bytes(ref_cache)), "KV caches differ after the write"
    if case.kv_cache_dtype == "auto":
        assert not (cache == 99.0).any(), "padding tokens must not be written"
    return max_error(out, ref_out, case.common.num_actual_tokens)


def compare_to_float(backend: type[AttentionBackend], case: AttnCase,
                     reference: type[AttentionBackend] | None = None) -> tuple[float, float]:
    """A quantized case through `backend`: (max error against attention over what its cache gives back, computed
    by `reference` (default: the same backend) on a float cache, max error against the float cache's output)."""
    reference = reference or backend
    out, cache = run_backend(backend, case)
    exact_out, exact_cache = run_backend(reference, dequantized(case))
    float_out, _ = run_backend(reference, float_case(case))
    fmt = kv_cache_format(case.kv_cache_dtype)
    # Rows written where they should not be (padding ones, say) would show here too.
    assert torch.equal(fmt.load(cache, exact_cache.dtype), exact_cache), "the cache holds other values than its rows"
    n = case.common.num_actual_tokens
    return max_error(out, exact_out, n), max_error(out, float_out, n)


def max_error(out: torch.Tensor, ref_out: torch.Tensor, n: int) -> float:
    """Max abs difference over the real rows; asserts shapes, dtypes, zero padding rows and finite outputs."""
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    assert torch.all(out[n:] == 0), "padding rows must be zero"
    assert torch.isfinite(out[:n]).all()
    return float((out[:n].float() - ref_out[:n].float()).abs().max()) if n else 0.0
