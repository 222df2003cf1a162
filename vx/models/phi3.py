"""Phi-3 and Phi-4-mini: a Llama-style decoder whose checkpoints store q/k/v and gate/up already fused.

The structure is Llama's (RMSNorm, SwiGLU, rotary with an optional partial rotary factor, LongRoPE scaling in the
long-context variants, a sliding window where the config sets one), so the model is `LlamaForCausalLM`; only
the weight names differ: `qkv_proj.weight` rows are [q; k; v] and `gate_up_proj.weight` rows [gate; up], which
are cut into the shards the fused layers load (so tensor-parallel sharding applies to each part as for Llama).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from vx.config import hf_head_dim, hf_num_kv_heads
from vx.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Serves Phi3ForCausalLM (Phi-3 mini/medium, Phi-3.5-mini, Phi-4-mini) on the Llama layers."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Split the fused checkpoint tensors, then load them as Llama's q/k/v and gate/up projections."""
        return super().load_weights(_unfused(weights, self.config))


def _unfused(weights: Iterable[tuple[str, torch.Tensor]], config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    head_dim = hf_head_dim(config)
    q_size = config.num_attention_heads * head_dim
    kv_size = hf_num_kv_heads(config) * head_dim
    for name, tensor in weights:
        if ".qkv_proj." in name:
            parts = _split_rows(name, tensor, [q_size, kv_size, kv_size])
            yield from zip((name.replace(".qkv_proj.", f".{p}.") for p in ("q_proj", "k_proj", "v_proj")), parts)
        elif ".gate_up_proj." in name:
            parts = _split_rows(name, tensor, [config.intermediate_size] * 2)
            yield from zip((name.replace(".gate_up_proj.", f".{p}.") for p in ("gate_proj", "up_proj")), parts)
        else:
            yield name, tensor


def _split_rows(name: str, tensor: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """A fused float weight or bias cut along its output rows; packed (quantized) tensors are laid out otherwise."""
    if not name.endswith((".weight", ".bias")) or tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name}: a fused Phi-3 tensor of dtype {tensor.dtype} cannot be split into its "
                         "projections; vx loads Phi-3 from float checkpoints.")
    if tensor.shape[0] != sum(sizes):
        raise ValueError(f"{name}: {tensor.shape[0]} rows, expected {sum(sizes)} ({' + '.join(map(str, sizes))}).")
    return tensor.split(sizes, dim=0)
