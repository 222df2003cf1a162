"""Mixture-of-experts MLP: top-k routing, then every expert runs once on all the tokens routed to it.

The experts' weights are stacked ([E, 2I, H] gate|up and [E, H, I] down), loaded expert by expert from checkpoints
that name them one by one (`ExpertWeightLoader`, which every MoE family's `load_weights` uses). Two paths compute the experts:
- CUDA tensors (float32/bfloat16/float16, triton importable): fused_moe_triton.py, two grouped-GEMM launches over
  expert-sorted blocks (moe_align.py), with no host sync, so the layer can run inside a CUDA graph.
- otherwise (the CPU's default): sort the (token, slot) assignments by expert, and each expert with tokens
  multiplies its rows in one matmul pair; experts run in ascending order and their weighted outputs are summed with
  `index_add_`, as Hugging Face's reference does, so float32 results agree to rounding. This loop reads the
  per-expert counts on the host, so it runs eagerly.

Tensor parallelism splits each expert along its intermediate dimension (gate|up by rows, down by columns): a rank
computes its partial sum over its slice, and the ranks' outputs are all-reduced once over the `tp_group` after the
top-k sum, as the row-parallel linear does. The router stays replicated.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from typing import TYPE_CHECKING, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from vx.distributed import GroupCoordinator

_SHARDS = ("w1", "w3", "w2")  # gate, up, down: the names vLLM and Mixtral use
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# A checkpoint's expert weight: (layer prefix, expert id, projection), in Hugging Face's or Mixtral's names.
_EXPERT_WEIGHT = re.compile(r"^(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_SHARD_OF = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3", "w2": "w2"}


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


class FusedMoE(nn.Module):
    """The experts of one MoE layer: `forward(hidden [T, H], router_logits [T, E]) -> [T, H]`."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, tp_size: int = 1, tp_rank: int = 0, prefix: str = "",
                 tp_group: GroupCoordinator | None = None) -> None:
        super().__init__()
        if tp_group is not None:
            tp_size, tp_rank = tp_group.world_size, tp_group.rank_in_group
        if not 0 < top_k <= num_experts:
            raise ValueError(f"{prefix}: top_k={top_k} for {num_experts} experts.")
        if intermediate_size % tp_size:
            raise ValueError(f"{prefix}: intermediate size {intermediate_size} does not split over {tp_size} ranks.")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_per_rank = intermediate_size // tp_size
        self.tp_size, self.tp_rank, self.tp_group = tp_size, tp_rank, tp_group
        self.prefix = prefix
        dtype = torch.get_default_dtype()
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate_per_rank, hidden_size,
                                                   dtype=dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate_per_rank, dtype=dtype),
                                      requires_grad=False)
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str, expert_id: int) -> None:
        """Copy one expert's gate (w1), up (w3) or down (w2) weight, this rank's slice of it, into the stack."""
        if shard_id not in _SHARDS or not 0 <= expert_id < self.num_experts:
            raise ValueError(f"{self.prefix}: no expert weight {shard_id!r} of expert {expert_id}.")
        size = self.intermediate_per_rank
        if shard_id == "w2":
            target = param.data[expert_id]
            source = loaded_weight.narrow(1, self.tp_rank * size, size)
        else:
            half = 0 if shard_id == "w1" else 1
            target = param.data[expert_id].narrow(0, half * size, size)
            source = loaded_weight.narrow(0, self.tp_rank * size, size)
        if target.shape != source.shape:
            raise ValueError(f"{self.prefix}: expert {expert_id} {shard_id} has shape {tuple(loaded_weight.shape)}, "
                             f"expected a slice of {tuple(target.shape)}.")
        target.copy_(source)

    def route(self, router_logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in `dtype`, expert ids [T, k]): softmax in float32, top-k, renormalised if asked."""
        probs = torch.softmax(router_logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(dtype), experts

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """The routed experts' outputs, weighted and summed per token (and over the tensor-parallel ranks)."""
        weights, experts = self.route(router_logits, hidden_states.dtype)
        return self.forward_routed(hidden_states, weights, experts)

    def graph_safe(self) -> bool:
        """Whether a forward reads nothing back to the host, so a CUDA graph can hold it: the Triton path only."""
        weight = self.w13_weight
        return weight.is_cuda and weight.dtype in _TRITON_DTYPES and _triton_importable()

    def forward_routed(self, hidden_states: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The experts given a routing already made (weights and expert ids [T, k]), for families that route
        otherwise: Triton on CUDA, the loop elsewhere, then the sum over the tensor-parallel ranks."""
        if hidden_states.is_cuda and hidden_states.dtype in _TRITON_DTYPES and _triton_importable():
            from vx.models.layers.fused_moe_triton import fused_experts

            out = fused_experts(hidden_states, self.w13_weight, self.w2_weight, weights, experts)
        else:
            out = self.forward_loop(hidden_states, weights, experts)
        if self.tp_size == 1:
            return out
        if self.tp_group is None:
            # Without the all-reduce the result would be silently partial.
            raise ValueError(f"{self.prefix}: tp_size={self.tp_size} without a tp_group to sum the ranks over.")
        return self.tp_group.all_reduce(out)

    def forward_loop(self, hidden_states: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """This rank's experts one matmul pair each, in ascending order (the eager path; reads counts on the host)."""
        flat_experts = experts.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        token_of = order // experts.shape[-1]  # the token each sorted assignment belongs to
        weight_of = weights.reshape(-1)[order]
        out = torch.zeros_like(hidden_states)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[start:start + count]
            gate, up = F.linear(hidden_states[tokens], self.w13_weight[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2_weight[expert])
            out.index_add_(0, tokens, y * weight_of[start:start + count, None])
            start += count
        return out


class ExpertWeightLoader:
    """Stacks a checkpoint's per-expert tensors into a model's `FusedMoE` stacks as they stream past, so a family's
    `load_weights` hands only the other tensors to the generic loader."""

    def __init__(self, params: dict[str, nn.Parameter], skip_prefixes: tuple[str, ...] = ()) -> None:
        self.params = params
        self.skip_prefixes = skip_prefixes  # layers another pipeline stage holds
        self._expected: dict[str, int] = {}
        self._seen: dict[str, set[tuple[int, str]]] = {}

    def others(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Load each expert tensor of `weights` into its stack; yield every other tensor unchanged."""
        for name, tensor in weights:
            match = _EXPERT_WEIGHT.match(name)
            if match is None:  # shared experts' names carry no expert id
                yield name, tensor
                continue
            layer, expert, shard = match.group(1), int(match.group(2)), _SHARD_OF[match.group(3)]
            if f"{layer}.".startswith(self.skip_prefixes):
                continue
            target = f"{layer}.experts.{'w2' if shard == 'w2' else 'w13'}_weight"
            param = self.params.get(target)
            if param is None:
                raise ValueError(f"{name}: the model has no routed experts at {layer}.")
            with torch.no_grad():
                param.weight_loader(param, tensor, shard, expert)
            self._expected[target] = param.shape[0] * (1 if shard == "w2" else 2)
            self._seen.setdefault(target, set()).add((expert, shard))

    def loaded(self) -> set[str]:
        """The stacks loaded so far: a stack counts once every expert's projections have arrived."""
        return {target for target, got in self._seen.items() if len(got) == self._expected[target]}
