"""Mixture-of-experts families on the Llama layers: Qwen3-MoE and Mixtral.

Their attention is Qwen3's (q/k norms) and Mistral's; their MLP is a router (a linear layer to one logit per
expert) feeding `FusedMoE`. Qwen3-MoE renormalises the top-k weights when `norm_topk_prob` says so and keeps
dense MLPs on its `mlp_only_layers` and off its `decoder_sparse_step`; Mixtral always renormalises and calls its
MLP `block_sparse_moe`, its experts' projections w1 (gate), w3 (up) and w2 (down). Checkpoints name each expert's
weights one by one; they are stacked per layer as they load. From a GGUF file the attention, dense MLPs, router and
embeddings stay quantized under the GGUF method while the experts arrive dequantized (vx/models/gguf/weights.py):
`FusedMoE` holds float stacks only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch
from torch import nn

from vx.models.causal_lm import CausalLM
from vx.models.layers.fused_moe import ExpertWeightLoader, FusedMoE
from vx.models.layers.linear import ReplicatedLinear
from vx.models.layers.quantization import QuantizationConfig
from vx.models.llama import LlamaModel

if TYPE_CHECKING:
    from vx.distributed import GroupCoordinator


class MoEMLP(nn.Module):
    """Router (replicated) then experts (split over the tensor-parallel ranks by intermediate feature)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 prefix: str, tp_group: GroupCoordinator | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False, quant_config=quant_config,
                                     prefix=f"{prefix}.gate")
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize,
                                prefix=f"{prefix}.experts", tp_group=tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The top-k experts' weighted outputs for each token of x [T, hidden]."""
        return self.experts(x, self.gate(x))


class MoECausalLM(CausalLM):
    """Loading for checkpoints whose experts come one tensor per expert and projection. With a `tp_group`, every
    layer holds this rank's shard (attention heads, dense and expert intermediate features, vocabulary rows); with a
    `pp_group`, only its pipeline stage's layers."""

    @property
    def supports_decode_graphs(self) -> bool:
        """On CUDA the experts are Triton kernels with no host read, and CUDA graphs hold them; the CPU's loop reads
        per-expert counts on the host, which a compiled decode graph cannot."""
        return all(m.graph_safe() for m in self.modules() if isinstance(m, FusedMoE))
    _mlp_name = "mlp"  # what the checkpoint calls a layer's MLP

    def __init__(self, hf_config: Any, quant_config: QuantizationConfig | None, mlp_for_layer: Any,
                 tp_group: GroupCoordinator | None = None, pp_group: GroupCoordinator | None = None) -> None:
        if quant_config is not None and quant_config.name != "gguf":
            raise ValueError(f"Quantized ({quant_config.name}) mixture-of-experts checkpoints are not supported yet: "
                             "load a float one, or a GGUF file (its experts are dequantized as they load).")
        super().__init__(hf_config, LlamaModel(hf_config, quant_config, mlp_for_layer=mlp_for_layer,
                                               tp_group=tp_group, pp_group=pp_group), quant_config,
                         tp_group=tp_group)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Stack each expert's projections into its layer's `FusedMoE`; the rest loads as for Llama."""
        experts = ExpertWeightLoader(dict(self.named_parameters()), skip_prefixes=self.missing_prefixes)
        renamed = ((name.replace(f".{self._mlp_name}.", ".mlp."), tensor) for name, tensor in weights)
        return super().load_weights(experts.others(renamed)) | experts.loaded()


class Qwen3MoeForCausalLM(MoECausalLM):
    """Serves Qwen3MoeForCausalLM (Qwen3-30B-A3B and its kin)."""

    def __init__(self, hf_config: Any, quant_config: QuantizationConfig | None = None,
                 tp_group: GroupCoordinator | None = None, pp_group: GroupCoordinator | None = None) -> None:
        config = hf_config
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)

        def mlp_for_layer(layer_idx: int, prefix: str) -> nn.Module | None:
            if layer_idx in dense or config.num_experts == 0 or (layer_idx + 1) % step:
                return None
            return MoEMLP(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                          config.moe_intermediate_size, bool(config.norm_topk_prob), prefix, tp_group, quant_config)

        super().__init__(hf_config, quant_config, mlp_for_layer, tp_group, pp_group)


class MixtralForCausalLM(MoECausalLM):
    """Serves MixtralForCausalLM (Mixtral 8x7B, 8x22B)."""

    _mlp_name = "block_sparse_moe"

    def __init__(self, hf_config: Any, quant_config: QuantizationConfig | None = None,
                 tp_group: GroupCoordinator | None = None, pp_group: GroupCoordinator | None = None) -> None:
        config = hf_config

        def mlp_for_layer(layer_idx: int, prefix: str) -> nn.Module:
            return MoEMLP(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                          config.intermediate_size, True, prefix, tp_group, quant_config)

        super().__init__(hf_config, quant_config, mlp_for_layer, tp_group, pp_group)
