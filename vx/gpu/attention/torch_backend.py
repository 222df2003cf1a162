"""Paged attention in plain PyTorch: runs anywhere torch runs (the CPU default, a CUDA fallback).

KV layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]. Each step the layer writes its new
k/v at `slot_mapping`, then:
  * all decode requests (one query token) attend together: their contexts are gathered through the block
    table into one padded [D, L] batch and masked, one SDPA call for the lot;
  * every other request (prefill, or a chunk continuing a cached prefix) runs its own SDPA call. A
    prefill with no cached prefix attends to its own fresh k/v with is_causal, skipping the cache gather.
Index tensors and masks are computed once per step in `build_metadata` and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from vx.gpu.attention.backend import AttentionBackend, AttentionImpl, CommonAttentionMetadata


@dataclass
class PrefillSpec:
    """One non-decode request of the step."""

    start: int                         # its rows in the flattened batch: [start, end)
    end: int
    seq_len: int                       # context length including this chunk
    ctx_slots: torch.Tensor | None     # int64 [seq_len] cache slots of positions 0..seq_len-1; None = no prefix

    @property
    def q_len(self) -> int:
        return self.end - self.start


@dataclass
class TorchAttentionMetadata:
    """Per-step index tensors for the torch backend (built once, read by every layer)."""

    num_actual_tokens: int
    slot_mapping: torch.Tensor               # int64 [num written tokens]
    write_rows: torch.Tensor | None          # rows of k/v to write, or None = rows [0, num_actual_tokens)
    num_decodes: int
    decode_rows: slice | torch.Tensor        # rows of the decode tokens in the batch
    decode_slots: torch.Tensor | None        # int64 [D, L]: cache slot of each context position (padded)
    decode_seq_lens: torch.Tensor | None     # int64 [D, 1]
    decode_positions: torch.Tensor | None    # int64 [1, L]
    prefills: list[PrefillSpec]
    _masks: dict[Any, torch.Tensor | None] = field(default_factory=dict, repr=False)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """bool [D, 1, 1, L]: True where a decode token may attend (its context, within the window)."""
        key = ("decode", window)
        if key not in self._masks:
            assert self.decode_positions is not None and self.decode_seq_lens is not None
            mask = self.decode_positions < self.decode_seq_lens
            if window is not None:
                mask &= self.decode_positions >= self.decode_seq_lens - window
            self._masks[key] = mask[:, None, None, :]
        return self._masks[key]  # type: ignore[return-value]

    def prefill_mask(self, i: int, window: int | None, device: torch.device) -> torch.Tensor | None:
        """bool [q_len, seq_len] for prefill request i, or None when plain top-left causal is exact."""
        p = self.prefills[i]
        if p.ctx_slots is None and window is None:
            return None
        key = ("prefill", i, window)
        if key not in self._masks:
            q_pos = torch.arange(p.seq_len - p.q_len, p.seq_len, device=device)[:, None]
            kv_pos = torch.arange(p.seq_len, device=device)[None, :]
            mask = kv_pos <= q_pos
            if window is not None:
                mask &= kv_pos > q_pos - window  # HF semantics: the last `window` positions, itself included
            self._masks[key] = mask
        return self._masks[key]


def _slots(block_table_rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each position through the given block-table rows; positions past the table clamp."""
    block_idx = (positions // block_size).clamp_(max=block_table_rows.shape[-1] - 1)
    return block_table_rows[..., block_idx].long() * block_size + positions % block_size


class TorchAttentionBackend(AttentionBackend):
    """Reference paged attention on torch SDPA; correct for any batch mix, fast enough on CPU."""

    @staticmethod
    def get_name() -> str:
        return "torch"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchAttentionImpl

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        """Split the batch into decodes and prefills and precompute their gather indices."""
        n = common.num_actual_tokens
        bs = common.block_size
        device = common.block_table.device
        slot_mapping = common.slot_mapping[:n].long()
        valid = slot_mapping >= 0
        write_rows = None
        if not bool(valid.all()):  # one sync per step, not per layer
            write_rows = valid.nonzero().squeeze(1)
            slot_mapping = slot_mapping[write_rows]
        qsl = common.query_start_loc_cpu.tolist()
        seq_lens = common.seq_lens_cpu.tolist()
        decode_reqs: list[int] = []
        prefills: list[PrefillSpec] = []
        for r in range(common.num_reqs):
            start, end = qsl[r], qsl[r + 1]
            q_len, seq_len = end - start, seq_lens[r]
            if q_len <= 0:
                continue
            if q_len == 1:
                decode_reqs.append(r)
                continue
            ctx_slots = None
            if seq_len > q_len:  # continues a cached prefix: read the whole context from the cache
                ctx_slots = _slots(common.block_table[r], torch.arange(seq_len, device=device), bs)
            prefills.append(PrefillSpec(start, end, seq_len, ctx_slots))
        num_decodes = len(decode_reqs)
        decode_rows: slice | torch.Tensor = slice(0, 0)
        decode_slots = decode_seq_lens = decode_positions = None
        if num_decodes:
            rows = [qsl[r] for r in decode_reqs]
            if rows == list(range(rows[0], rows[0] + num_decodes)):
                decode_rows = slice(rows[0], rows[0] + num_decodes)  # a view instead of a gather
            else:
                decode_rows = torch.tensor(rows, dtype=torch.long, device=device)
            max_len = max(seq_lens[r] for r in decode_reqs)
            req_idx = torch.tensor(decode_reqs, dtype=torch.long, device=device)
            decode_positions = torch.arange(max_len, device=device)[None, :]
            decode_slots = _slots(common.block_table[req_idx], decode_positions[0], bs)
            decode_seq_lens = torch.tensor([seq_lens[r] for r in decode_reqs], dtype=torch.long,
                                           device=device)[:, None]
        return TorchAttentionMetadata(
            num_actual_tokens=n, slot_mapping=slot_mapping, write_rows=write_rows, num_decodes=num_decodes,
            decode_rows=decode_rows, decode_slots=decode_slots, decode_seq_lens=decode_seq_lens,
            decode_positions=decode_positions, prefills=prefills)


class TorchAttentionImpl(AttentionImpl):
    """Per-layer forward of the torch backend."""

    def forward(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: TorchAttentionMetadata) -> torch.Tensor:
        """Write k/v at the step's slots, then attend decodes (batched) and prefills (one by one)."""
        md = attn_metadata
        num_tokens = q.shape[0]
        n = md.num_actual_tokens
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        k = k.reshape(num_tokens, hk, d)
        v = v.reshape(num_tokens, hk, d)
        key_cache = kv_cache[0].view(-1, hk, d)
        value_cache = kv_cache[1].view(-1, hk, d)
        if md.write_rows is None:
            key_cache.index_copy_(0, md.slot_mapping, k[:n])
            value_cache.index_copy_(0, md.slot_mapping, v[:n])
        else:
            key_cache.index_copy_(0, md.slot_mapping, k.index_select(0, md.write_rows))
            value_cache.index_copy_(0, md.slot_mapping, v.index_select(0, md.write_rows))

        out = q.new_empty(num_tokens, h * d)
        if num_tokens > n:
            out[n:].zero_()  # padding rows: defined output, never attended
        if md.num_decodes:
            self._decode(q, key_cache, value_cache, md, out)
        gqa = h != hk
        for i, p in enumerate(md.prefills):
            qp = q[p.start:p.end].reshape(p.q_len, h, d).transpose(0, 1).unsqueeze(0)
            if p.ctx_slots is None:
                kp, vp = k[p.start:p.end], v[p.start:p.end]
            else:
                kp, vp = key_cache[p.ctx_slots], value_cache[p.ctx_slots]
            kp = kp.transpose(0, 1).unsqueeze(0)
            vp = vp.transpose(0, 1).unsqueeze(0)
            mask = md.prefill_mask(i, self.sliding_window, q.device)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=mask is None,
                                               scale=self.scale, enable_gqa=gqa)
            out[p.start:p.end] = o[0].transpose(0, 1).reshape(p.q_len, h * d)
        return out

    def _decode(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                md: TorchAttentionMetadata, out: torch.Tensor) -> None:
        """All single-token queries at once; GQA by viewing q as [D, kv_heads, group, head_dim]."""
        hk, d = self.num_kv_heads, self.head_dim
        nd = md.num_decodes
        assert md.decode_slots is not None
        # The group of query heads sharing a kv head acts as the query "length" of that kv head.
        qd = q[md.decode_rows].reshape(nd, hk, self.num_heads // hk, d)
        kd = key_cache[md.decode_slots].transpose(1, 2)  # [D, hk, L, d]
        vd = value_cache[md.decode_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=md.decode_mask(self.sliding_window),
                                           scale=self.scale)
        out[md.decode_rows] = o.reshape(nd, self.num_heads * d)
