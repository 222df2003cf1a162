"""Paged attention in Triton: one kernel for every batch mix (prefills, prefill chunks, decodes) on CUDA.

KV layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim], the torch backend's, so caches,
sizing and tests are shared. Each step a layer runs two kernels (see triton_kernels.py):
  * `write_kv_kernel` stores the new k/v at `slot_mapping` (-1 = padding, skipped by a store mask, so
    padding costs no host sync: a Triton kernel rather than torch indexing for that reason);
  * `paged_attention_kernel` attends every query tile of every request over its blocks.
The kernel looks up the block of each key position, so any power-of-two block size works (16 in
production, 4/8 in tests); head_dim up to 256 (padded to a power of two >= 16 inside the kernel);
float32 (IEEE dot products, no TF32), bfloat16 and float16. Runs on CUDA, or on CPU tensors under Triton's
interpreter (TRITON_INTERPRET=1, for tests).

A quantized cache (`kv_cache_dtype` fp8_e4m3 / int8): the step's k/v are quantized in torch (`KVCacheFormat.store`,
elementwise, no host sync) and the write kernel copies their bytes like any row; the attention kernel reads the
codes and dequantizes them per tile (KV_KIND), so the cache is never expanded.

Per step `build_metadata` keeps the shared index tensors; the (request, first query) list of the query
tiles depends on the tile height, so it is built by the first layer and cached for the others.

Inside a CUDA graph (`vx.gpu.graphs`) a layer gets `DecodeGraphMetadata` instead: row i is request i's one
query, so the query starts and tiles are aranges of the batch size, made once per size outside the capture (during
its warm-up) and read in place by every replay; nothing on the way syncs with the host.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from functools import lru_cache
from types import ModuleType
from typing import Any

import torch

from vx.gpu.attention.backend import (AttentionBackend, AttentionImpl, CommonAttentionMetadata, DecodeGraphMetadata,
                                     as_bytes)
from vx.gpu.attention.kv_format import kv_cache_format

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
# kv_cache_dtype -> the attention kernel's KV_KIND: how it reads the cache's rows.
_KV_KINDS = {"auto": 0, "fp8_e4m3": 1, "int8": 2}


@lru_cache(maxsize=None)
def _kernels() -> ModuleType:
    """triton_kernels, imported on first use so that merely selecting backends never imports triton."""
    from vx.gpu.attention import triton_kernels

    return triton_kernels


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of the attention kernel for one layer shape and batch kind."""

    group_pad: int   # query heads per kv head, rounded up to a power of two
    block_q: int     # query tokens per tile
    block_m: int     # rows of the query tile: block_q * group_pad (>= 16, tl.dot's minimum)
    block_n: int     # key positions per inner-loop step
    head_dim_pad: int
    num_warps: int


def tile_config(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                decode_only: bool) -> TileConfig:
    """Pick tile sizes: short tiles for all-decode steps (one query per request), taller ones otherwise.

    A decode tile holds a single query, so its rows are the GQA group (padded to tl.dot's 16); a prefill
    tile holds 64 rows so each K/V tile loaded from the cache serves many queries.
    """
    group_pad = _next_pow2(num_heads // num_kv_heads)
    rows = 16 if decode_only else 64
    block_q = max(1, rows // group_pad)
    head_dim_pad = max(16, _next_pow2(head_dim))
    # Keep a K and a V tile (times pipelining stages) well inside shared memory for wide heads / fp32.
    block_n = 64 if head_dim_pad * dtype.itemsize <= 256 else 32
    return TileConfig(group_pad, block_q, block_q * group_pad, block_n, head_dim_pad, 4)


@dataclass
class TritonAttentionMetadata:
    """Per-step tensors for the triton backend (built once, read by every layer)."""

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    block_size: int
    query_start_loc: torch.Tensor      # int32 [num_reqs+1], device
    query_start_loc_cpu: torch.Tensor  # same on CPU: sizes the grid without a device sync
    seq_lens: torch.Tensor             # int32 [num_reqs], device
    block_table: torch.Tensor          # int32 [num_reqs, max_blocks], device
    slot_mapping: torch.Tensor         # int64 [>= num_actual_tokens], device; -1 = padding
    _tiles: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def tiles(self, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(request index, first query index) of each query tile of height block_q, int32 on device."""
        if block_q not in self._tiles:
            q_lens = self.query_start_loc_cpu[1:self.num_reqs + 1] - self.query_start_loc_cpu[:self.num_reqs]
            n_tiles = (q_lens.long() + block_q - 1) // block_q
            req = torch.repeat_interleave(torch.arange(self.num_reqs), n_tiles)
            first_tile = torch.cumsum(n_tiles, 0) - n_tiles
            q0 = (torch.arange(req.numel()) - first_tile[req]) * block_q
            device = self.block_table.device
            self._tiles[block_q] = (req.to(device=device, dtype=torch.int32),
                                    q0.to(device=device, dtype=torch.int32))
        return self._tiles[block_q]


class TritonAttentionBackend(AttentionBackend):
    """Unified paged attention on Triton kernels (CUDA; CPU only under TRITON_INTERPRET=1)."""

    @staticmethod
    def get_name() -> str:
        return "triton"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonAttentionImpl

    @staticmethod
    def unavailable_reason(device_type: str) -> str | None:
        """Why the backend cannot run on `device_type` ('cpu'/'cuda') in this process (None = it can)."""
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if device_type == "cuda":
            return None if torch.cuda.is_available() else "triton needs CUDA, and torch sees no CUDA device"
        if device_type == "cpu":
            if os.environ.get("TRITON_INTERPRET") == "1":
                return None
            return "triton needs CUDA or TRITON_INTERPRET=1 (the interpreter, for tests) on device 'cpu'"
        return f"triton runs on CUDA only, not on {device_type!r}"

    @staticmethod
    def unsupported_reason(*, dtype: torch.dtype | None = None, head_dim: int | None = None,
                           block_size: int | None = None, kv_cache_dtype: str | None = None) -> str | None:
        """Why this backend cannot serve the given shape (None = it can); unknown arguments pass."""
        if kv_cache_dtype is not None:
            reason = kv_cache_format(kv_cache_dtype).unsupported_reason(head_dim)
            if reason is not None:
                return reason
        if dtype is not None and dtype not in SUPPORTED_DTYPES:
            return f"triton attention supports float32/bfloat16/float16, not {dtype}"
        if head_dim is not None and not 0 < head_dim <= MAX_HEAD_DIM:
            return f"triton attention supports head_dim 1..{MAX_HEAD_DIM}, got {head_dim}"
        if block_size is not None and (block_size < 1 or block_size & (block_size - 1)):
            return f"triton attention needs a power-of-two block_size, got {block_size}"
        return None

    @staticmethod
    def supports_decode_graphs(device_type: str) -> bool:
        """CUDA graphs: its decode path reads `DecodeGraphMetadata` with device tensors only."""
        return device_type == "cuda"

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        """Keep the common tensors in the dtypes the kernels read; no host sync."""
        return TritonAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens, num_reqs=common.num_reqs,
            max_query_len=common.max_query_len, block_size=common.block_size,
            query_start_loc=common.query_start_loc.to(torch.int32),
            query_start_loc_cpu=common.query_start_loc_cpu.to(torch.int32),
            seq_lens=common.seq_lens.to(torch.int32), block_table=common.block_table.to(torch.int32),
            slot_mapping=common.slot_mapping.to(torch.int64))


def _row_major(x: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """x as [rows, width] with a unit last stride (a view when possible; q/k/v may be slices of qkv)."""
    x = x.reshape(rows, width)
    return x if x.stride(-1) == 1 else x.contiguous()


class TritonAttentionImpl(AttentionImpl):
    """Per-layer forward of the triton backend."""

    supports_logits_soft_cap = True

    def forward(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: TritonAttentionMetadata | DecodeGraphMetadata) -> torch.Tensor:
        """Write k/v at the step's slots, then one unified attention launch for all requests."""
        if isinstance(attn_metadata, DecodeGraphMetadata):
            attn_metadata = self._graph_metadata(attn_metadata, kv_cache.shape[2])
        md = attn_metadata
        kern = _kernels()
        num_tokens = q.shape[0]
        n = md.num_actual_tokens
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        fmt = self.kv_format
        # The dtype of the dot products: the cache's, or for a quantized cache the model's (q's).
        compute_dtype = q.dtype if fmt.quantized else kv_cache.dtype
        if compute_dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"triton attention does not support {compute_dtype} (KV cache {kv_cache.dtype}).")
        if compute_dtype == torch.bfloat16 and kv_cache.device.type == "cpu":
            # Triton 3.9's interpreter multiplies bf16 tiles as raw integers: refuse instead of garbage.
            raise ValueError("triton attention under TRITON_INTERPRET=1 supports float32/float16 only; "
                             "bfloat16 needs CUDA.")
        q = _row_major(q, num_tokens, h * d)
        width = kv_cache.shape[-1]  # a row of the cache: head_dim values, or a quantized row
        if fmt.quantized:
            k = as_bytes(fmt.store(k.reshape(num_tokens, hk, d), kv_cache.dtype)).reshape(num_tokens, hk * width)
            v = as_bytes(fmt.store(v.reshape(num_tokens, hk, d), kv_cache.dtype)).reshape(num_tokens, hk * width)
        else:
            k = _row_major(k, num_tokens, hk * d)
            v = _row_major(v, num_tokens, hk * d)
            if k.dtype != kv_cache.dtype:
                k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
        key_cache, value_cache = as_bytes(kv_cache[0]), as_bytes(kv_cache[1])
        slot_stride = hk * width  # the cache is allocated contiguous: one slot is one [hk, width] row
        if n > 0:
            row_pad = _next_pow2(hk * width)
            kern.write_kv_kernel[(n,)](
                k, v, key_cache, value_cache, md.slot_mapping,
                k.stride(0), v.stride(0), slot_stride, ROW=hk * width, ROW_PAD=row_pad)

        out = self.new_output(q, n)
        if n == 0:
            return out
        kind = _KV_KINDS[fmt.name]
        if kind == 2:  # int8: each row's float32 scale follows its codes
            scales = kv_cache.view(torch.float32)
            k_scales, v_scales = scales[0], scales[1]
        else:  # unused by the kernel
            k_scales, v_scales = key_cache, value_cache
        cfg = tile_config(h, hk, d, compute_dtype, md.max_query_len <= 1)
        tile_req, tile_q0 = md.tiles(cfg.block_q)
        window = self.sliding_window
        soft_cap = self.logits_soft_cap
        # log2(e) turns the softmax's exp into exp2; with a soft cap the kernel applies it after the cap.
        qk_scale = self.scale * fmt.tensor_scale * (1.0 if soft_cap is not None else math.log2(math.e))
        kern.paged_attention_kernel[(tile_req.numel(), hk)](
            q, key_cache, value_cache, out, k_scales, v_scales, tile_req, tile_q0,
            md.query_start_loc, md.seq_lens, md.block_table,
            qk_scale, fmt.tensor_scale,
            window if window is not None else 0, float(soft_cap) if soft_cap is not None else 0.0,
            q.stride(0), d, out.stride(0), d, slot_stride, width, md.block_table.stride(0),
            slot_stride // 4, width // 4, d // 4,
            GROUP=h // hk, GROUP_PAD=cfg.group_pad, BLOCK_Q=cfg.block_q, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, HEAD_DIM=d, HEAD_DIM_PAD=cfg.head_dim_pad, KV_BLOCK_SIZE=md.block_size,
            USE_WINDOW=window is not None,
            DOT_PRECISION="ieee" if compute_dtype == torch.float32 else "tf32",
            KV_KIND=kind, SOFT_CAP=soft_cap is not None, num_warps=cfg.num_warps)
        return out

    def _graph_metadata(self, md: DecodeGraphMetadata, block_size: int) -> TritonAttentionMetadata:
        """A decode graph's step as the kernels' metadata: one query per row, its tiles the rows themselves.

        The index tensors of a batch size are made on its first call (the capture's eager warm-up) and kept, so
        the captured kernels read them in place; a graph's buffers (slot_mapping, block_table, seq_lens) are
        used as they are.
        """
        num_rows = md.seq_lens.shape[0]
        device = md.seq_lens.device
        cache: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = self.__dict__.setdefault(
            "_graph_rows", {})
        if (num_rows, device) not in cache:
            starts = torch.arange(num_rows + 1, dtype=torch.int32, device=device)
            cache[num_rows, device] = (starts, torch.zeros(num_rows, dtype=torch.int32, device=device))
        starts, zeros = cache[num_rows, device]
        meta = TritonAttentionMetadata(
            num_actual_tokens=num_rows, num_reqs=num_rows, max_query_len=1, block_size=block_size,
            query_start_loc=starts, query_start_loc_cpu=torch.arange(num_rows + 1, dtype=torch.int32),
            seq_lens=md.seq_lens, block_table=md.block_table, slot_mapping=md.slot_mapping)
        # One query per request: one tile per row, whatever the tile height (which the dtype does not change).
        block_q = tile_config(self.num_heads, self.num_kv_heads, self.head_dim, torch.float32, True).block_q
        meta._tiles[block_q] = (starts[:num_rows], zeros)
        return meta
