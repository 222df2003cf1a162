"""DeepSeek-V2 (and V2-Lite): Multi-head Latent Attention and a mixture of routed and shared experts.

Attention (`DeepseekV2Attention`): q from q_proj, or through the low-rank q_a_proj -> q_a_layernorm -> q_b_proj when
`q_lora_rank` is set; kv_a_proj_with_mqa gives each token's compressed kv (kv_lora_rank, then kv_a_layernorm) and one
rotary key part (qk_rope_head_dim) shared by the heads. Only those two are cached (`vx.models.layers.mla`); kv_b_proj
expands the latent into the heads' non-rotary keys and values. The rotary part rotates interleaved pairs (x0, x1),
(x2, x3), ... as Hugging Face's DeepseekV2 does (a complex product), not the two halves as Llama does. With YaRN
scaling the softmax scale is qk_head_dim^-0.5 times mscale(factor, mscale_all_dim)^2, as in DeepSeek's code.

MLP: dense (SwiGLU) on the first `first_k_dense_replace` layers and off the `moe_layer_freq` stride, else routed
experts (`vx.models.layers.grouped_topk` routing through `FusedMoE`) plus `n_shared_experts` shared ones, a dense MLP
every token runs, added.

From a GGUF file (vx/models/gguf/deepseek2.py, vx/models/gguf/weights.py) the projections, dense and shared-expert
MLPs, embedding and head run quantized through the GGUF method; kv_b_proj stays a float weight (the MLA backend reads
it per head, `MLAAttention.up_projection`, for the absorbed decode), and the router and routed experts are float as
for Hugging Face checkpoints: the loader dequantizes them.

Refused by name: quantized checkpoints other than GGUF files, `norm_topk_prob` (Hugging Face's DeepseekV2 ignores
it, DeepSeek's own code renormalises: no one reference to be equal to), topk methods other than greedy /
group_limited_greedy, a `scoring_func` other than softmax.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vx.models.causal_lm import CausalLM
from vx.models.layers.fused_moe import ExpertWeightLoader, FusedMoE
from vx.models.layers.grouped_topk import check_routing, deepseek_v2_route
from vx.models.layers.linear import ReplicatedLinear
from vx.models.layers.mla import MLAAttention
from vx.models.layers.norm import RMSNorm
from vx.models.layers.quantization import QuantizationConfig
from vx.models.layers.rotary import RotaryEmbedding, get_rope, get_rope_config
from vx.models.layers.vocab_embedding import VocabParallelEmbedding
from vx.models.llama import LlamaMLP, PreNormDecoderLayer


def mla_softmax_scale(config: Any) -> float:
    """qk_head_dim^-0.5, times mscale^2 when a scaled rope sets `mscale_all_dim` (DeepSeek's YaRN)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = get_rope_config(config)
    mscale_all_dim = rope.params.get("mscale_all_dim")
    if rope.rope_type != "default" and mscale_all_dim:
        factor = float(rope.params["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, d] by pairs of neighbours (x[2i], x[2i+1]) through angle i; cos/sin are the rotary's
    [T, 1, d] (cos|cos, -sin|sin halves, see `RotaryEmbedding`)."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., half:]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)


class DeepseekV2Attention(nn.Module):
    """MLA: projections, kv_a_layernorm, interleaved rotary on the rope parts, the latent cache, o_proj."""

    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding, prefix: str,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        qc = quant_config
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size
        if self.q_lora_rank is None:
            self.q_proj = ReplicatedLinear(hidden, self.num_heads * qk_head_dim, quant_config=qc,
                                           prefix=f"{prefix}.q_proj")
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias, quant_config=qc,
                                             prefix=f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=1e-6)
            self.q_b_proj = ReplicatedLinear(self.q_lora_rank, self.num_heads * qk_head_dim, quant_config=qc,
                                             prefix=f"{prefix}.q_b_proj")
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias,
                                                   quant_config=qc, prefix=f"{prefix}.kv_a_proj_with_mqa")
        # Hugging Face's DeepseekV2 builds q_a_layernorm and this norm with its default eps (1e-6), not rms_norm_eps.
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=1e-6)
        # Always float: the MLA backend reads its weight per head (a GGUF file's is dequantized as it loads).
        self.kv_b_proj = ReplicatedLinear(self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim),
                                          prefix=f"{prefix}.kv_b_proj")
        self.o_proj = ReplicatedLinear(self.num_heads * self.v_head_dim, hidden, bias=bias, quant_config=qc,
                                       prefix=f"{prefix}.o_proj")
        self.__dict__["rotary_emb"] = rotary_emb  # shared by every layer
        self.attn = MLAAttention(self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim,
                                 self.v_head_dim, mla_softmax_scale(config), self.kv_b_proj, layer_idx=layer_idx)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        """hidden [T, hidden] -> attention output [T, hidden]."""
        t = hidden_states.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(t, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.qk_rope_head_dim],
                                                                     dim=-1)
        q_rope = rotate_interleaved(q[..., self.qk_nope_head_dim:], cos, sin)
        k_rope = rotate_interleaved(k_rope.unsqueeze(1), cos, sin).squeeze(1)
        q = torch.cat((q[..., :self.qk_nope_head_dim], q_rope), dim=-1)
        row = torch.cat((self.kv_a_layernorm(latent), k_rope), dim=-1)
        return self.o_proj(self.attn(q, row, None, attn_metadata))


class DeepseekV2Experts(FusedMoE):
    """The routed experts, choosing them DeepSeek's way: `FusedMoE` runs them, this overrides only its `route`."""

    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__(config.n_routed_experts, config.num_experts_per_tok, config.hidden_size,
                         config.moe_intermediate_size, renormalize=False, prefix=prefix)
        self.topk_method, self.n_group, self.topk_group = config.topk_method, config.n_group, config.topk_group
        self.routed_scaling_factor = float(config.routed_scaling_factor)

    def route(self, router_logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in `dtype`, expert ids [T, k]): grouped or plain top-k of the softmax, scaled."""
        weights, experts = deepseek_v2_route(router_logits, self.top_k, self.topk_method, self.n_group,
                                             self.topk_group, self.routed_scaling_factor)
        return weights.to(dtype), experts


class DeepseekV2MoE(nn.Module):
    """Router (float32), routed experts through `FusedMoE`, plus the shared experts' dense MLP."""

    def __init__(self, config: Any, prefix: str, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        num_experts, top_k = config.n_routed_experts, config.num_experts_per_tok
        check_routing(num_experts, top_k, config.topk_method, config.n_group, config.topk_group)
        # The router's weight stays float32 whatever the model's dtype, as Hugging Face keeps it.
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(num_experts, config.hidden_size, dtype=torch.float32),
                                        requires_grad=False)
        self.experts = DeepseekV2Experts(config, prefix=f"{prefix}.experts")
        self.shared_experts = None
        if config.n_shared_experts:
            self.shared_experts = LlamaMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                                           quant_config=quant_config, prefix=f"{prefix}.shared_experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Routed experts' weighted outputs plus the shared experts' output, for x [T, hidden]."""
        out = self.experts(x, F.linear(x.float(), self.gate.weight))
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekV2DecoderLayer(PreNormDecoderLayer):
    """Pre-norm decoder layer: MLA attention, then the experts (or a dense MLP in the first layers)."""

    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding, prefix: str,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.self_attn = DeepseekV2Attention(config, layer_idx, rotary_emb, f"{prefix}.self_attn", quant_config)
        freq = int(getattr(config, "moe_layer_freq", 1) or 1)
        sparse = (config.n_routed_experts and layer_idx >= config.first_k_dense_replace and layer_idx % freq == 0)
        self.mlp: nn.Module = (DeepseekV2MoE(config, f"{prefix}.mlp", quant_config) if sparse else
                               LlamaMLP(config.hidden_size, config.intermediate_size, quant_config=quant_config,
                                        prefix=f"{prefix}.mlp"))
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DeepseekV2Model(nn.Module):
    """Embedding, decoder layers and final norm."""

    def __init__(self, config: Any, prefix: str = "model", quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                                   prefix=f"{prefix}.embed_tokens")
        self.rotary_emb = get_rope(config, config.qk_rope_head_dim)
        self.layers = nn.ModuleList(DeepseekV2DecoderLayer(config, i, self.rotary_emb, f"{prefix}.layers.{i}",
                                                           quant_config)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        """Token ids [T] and positions [T] -> final-normed hidden states [T, hidden]."""
        hidden_states = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions, hidden_states.dtype)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, cos, sin, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


def _check_config(config: Any, quant_config: QuantizationConfig | None) -> None:
    if quant_config is not None and getattr(quant_config, "name", None) != "gguf":
        name = getattr(quant_config, "name", type(quant_config).__name__)
        raise ValueError(f"Quantized DeepSeek-V2 checkpoints ({name}) are not supported: load a float one, or a GGUF "
                         "file.")
    if getattr(config, "norm_topk_prob", False):
        raise ValueError("norm_topk_prob=True is not supported for DeepseekV2ForCausalLM: Hugging Face's DeepseekV2 "
                         "ignores it and DeepSeek's code renormalises the top-k weights, so there is no one "
                         "reference to match.")
    scoring = getattr(config, "scoring_func", "softmax") or "softmax"
    if scoring != "softmax":
        raise ValueError(f"scoring_func={scoring!r} is not supported for DeepseekV2ForCausalLM (softmax only).")
    if config.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim={config.qk_rope_head_dim} must be even (it rotates pairs).")
    if getattr(config, "num_key_value_heads", config.num_attention_heads) != config.num_attention_heads:
        raise ValueError("DeepSeek-V2's MLA has num_key_value_heads == num_attention_heads; got "
                         f"{config.num_key_value_heads} for {config.num_attention_heads} heads.")


class DeepseekV2ForCausalLM(CausalLM):
    """Serves DeepseekV2ForCausalLM (DeepSeek-V2, DeepSeek-V2-Lite, their chat models), from float checkpoints and
    GGUF files."""

    supports_decode_graphs = False  # the experts' loop reads per-expert counts on the host
    # Only the MLPs' gate/up fuse; the attention's projections load one by one (q_proj is no qkv shard here).
    _stacked_params: list[tuple[str, str, str | int]] = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
    packed_modules_mapping = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, hf_config: Any, quant_config: QuantizationConfig | None = None) -> None:
        _check_config(hf_config, quant_config)
        super().__init__(hf_config, DeepseekV2Model(hf_config, quant_config=quant_config), quant_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Stack each routed expert's projections into its layer's `FusedMoE`; the rest loads as for Llama (the
        dense and shared experts' gate/up fused into gate_up_proj)."""
        experts = ExpertWeightLoader(dict(self.named_parameters()))
        return super().load_weights(experts.others(weights)) | experts.loaded()
