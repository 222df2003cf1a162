"""Paged attention for the CPU: the torch backend, with decode attention in a C kernel that reads the cache in place.

Decode dominates a CPU step's attention time, and it is memory-bound: the torch backend gathers each context
into a padded batch before SDPA, so the KV bytes cross memory three times. The kernel
(`csrc/paged_decode.c`) streams each sequence's blocks once, from a cache in the model's dtype (float32, bf16,
fp16) or a quantized one (fp8_e4m3, int8); rows other than float32 are decoded 16 at a time into a buffer in L1,
and the arithmetic is float32's. Prefills, the KV write and anything the kernel does not handle (a head wider than
256) stay on the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vx.gpu.attention.backend import AttentionImpl, CommonAttentionMetadata, DecodeGraphMetadata
from vx.gpu.attention.cpu_kernels import load_paged_decode_kernel, register_paged_decode_op
from vx.gpu.attention.torch_backend import TorchAttentionBackend, TorchAttentionImpl, TorchAttentionMetadata


@dataclass
class CpuAttentionMetadata(TorchAttentionMetadata):
    """The torch backend's metadata plus the decode requests' rows, block tables and lengths for the kernel."""

    decode_rows: torch.Tensor | None = None         # int64 [Nd]: each decode request's row in the batch
    decode_block_table: torch.Tensor | None = None  # int32 [Nd, nb], contiguous
    decode_seq_lens: torch.Tensor | None = None     # int32 [Nd]


class CpuAttentionBackend(TorchAttentionBackend):
    """The CPU default when the C kernel builds (`attention_backend="cpu"`); same KV layout as "torch"."""

    @staticmethod
    def get_name() -> str:
        return "cpu"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return CpuAttentionImpl

    # Every shape and KV-cache format the torch backend serves is accepted: what the kernel does not handle falls
    # back to the torch path.
    @staticmethod
    def unavailable_reason(device_type: str) -> str | None:
        """Why this backend cannot run here (None = it can)."""
        if device_type != "cpu":
            return "it runs on the CPU only"
        if load_paged_decode_kernel() is None:
            return "its C kernel could not be built (no C compiler, or VX_CPU_KERNELS=0)"
        return None

    @staticmethod
    def supports_decode_graphs(device_type: str) -> bool:
        """Decode graphs call the kernel as the `vx::paged_decode_attention` operator."""
        if device_type != "cpu" or load_paged_decode_kernel() is None:
            return False
        register_paged_decode_op()
        return True

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> CpuAttentionMetadata:
        base = super().build_metadata(common)
        md = CpuAttentionMetadata(**{f: getattr(base, f) for f in base.__dataclass_fields__ if f != "_masks"})
        if md.decode_reqs:
            reqs = torch.tensor(md.decode_reqs, dtype=torch.int64)
            seq_lens = common.seq_lens_cpu[reqs]
            nb = -(-int(seq_lens.max()) // common.block_size)
            md.decode_rows = common.query_start_loc_cpu[reqs].long()
            md.decode_block_table = common.block_table[reqs, :nb].to(torch.int32).contiguous()
            md.decode_seq_lens = seq_lens.to(torch.int32).contiguous()
        return md


class CpuAttentionImpl(TorchAttentionImpl):
    """Decodes through the C kernel (float32, bf16 or fp16 model; any KV-cache format); the rest as the torch backend."""

    def forward(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        """A decode graph's step in one operator call (k/v write and attention); any other step as the torch
        backend, with decodes through the kernel."""
        if isinstance(attn_metadata, DecodeGraphMetadata):
            if self.logits_soft_cap is not None:
                raise ValueError("a soft-capped layer cannot run in a decode graph (the model should have said so).")
            md = attn_metadata
            return torch.ops.vx.paged_decode_attention(q, k, v, kv_cache, md.slot_mapping, md.block_table,
                                                       md.seq_lens, self.scale, self.sliding_window or 0,
                                                       self.num_heads, self.kv_format.name)
        return super().forward(layer, q, k, v, kv_cache, attn_metadata)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, md: Any, out: torch.Tensor) -> None:
        kernel = load_paged_decode_kernel()
        # The kernel does not soft-cap scores: such layers (Gemma 2) decode through the torch path.
        if (kernel is not None and md.decode_rows is not None and self.logits_soft_cap is None
                and kernel(q, md.decode_rows, kv_cache, md.decode_block_table, md.decode_seq_lens, self.scale,
                           self.sliding_window, out, self.num_heads, self.kv_format)):
            return
        super()._decode(q, kv_cache, md, out)
