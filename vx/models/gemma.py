"""Gemma 2 and Gemma 3 (text): sliding-window and global layers interleaved, norms before and after both the
attention and the MLP, GELU (tanh) gating, embeddings scaled by sqrt(hidden) and tied to the LM head, queries scaled
by `query_pre_attn_scalar`, final logit soft-capping where the config sets it.

Gemma 2 soft-caps the attention scores too (`attn_logit_softcapping`, applied by the torch, cpu and triton
backends; its decode runs eagerly, since the CPU decode kernel does not cap). Gemma 3 instead normalises q and k per head and
gives each layer kind its own rotary (base 10k on sliding layers, 1M, maybe scaled, on global ones). Gemma's
RMSNorm stores its weight as an offset from 1 (`GemmaRMSNorm`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vx.config import hf_head_dim, hf_num_kv_heads
from vx.models.causal_lm import CausalLM
from vx.models.layers.activation import GeluAndMul
from vx.models.layers.attention import Attention
from vx.models.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vx.models.layers.norm import GemmaRMSNorm
from vx.models.layers.quantization import QuantizationConfig
from vx.models.layers.rotary import RotaryEmbedding, get_rope
from vx.models.layers.vocab_embedding import VocabParallelEmbedding
from vx.models.registry import architecture_of

_GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


def _layer_types(config: Any) -> list[str]:
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"Gemma layer types {unknown} are not supported (full_attention, sliding_attention).")
    return types


class GemmaMLP(nn.Module):
    """GELU-gated MLP with gate and up projections fused into one matmul."""

    def __init__(self, config: Any, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        if activation not in _GELU_APPROXIMATIONS:
            raise ValueError(f"Gemma hidden_activation {activation!r} is not supported "
                             f"({', '.join(_GELU_APPROXIMATIONS)}).")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=False,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")
        self.act_fn = GeluAndMul(_GELU_APPROXIMATIONS[activation])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(gelu(gate(x)) * up(x))."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaAttention(nn.Module):
    """Self-attention: fused qkv, q/k norms, the rotary of its layer kind, paged attention (windowed on sliding
    layers), o_proj."""

    def __init__(self, config: Any, layer_idx: int, layer_type: str, rotary_emb: RotaryEmbedding,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.head_dim = hf_head_dim(config)
        row = architecture_of(config)
        self.use_qk_norm = row is not None and row.qk_norm
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          hf_num_kv_heads(config), bias=bias, quant_config=quant_config,
                                          prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        if self.use_qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.__dict__["rotary_emb"] = rotary_emb  # shared by the layers of its kind, not a submodule of each
        window = int(config.sliding_window) if layer_type == "sliding_attention" else None
        self.attn = Attention(self.qkv_proj.num_heads, self.head_dim, config.query_pre_attn_scalar ** -0.5,
                              self.qkv_proj.num_kv_heads, layer_idx=layer_idx, sliding_window=window,
                              logits_soft_cap=getattr(config, "attn_logit_softcapping", None))

    def forward(self, hidden_states: torch.Tensor, positions_cos_sin: tuple[torch.Tensor, torch.Tensor],
                attn_metadata: Any) -> torch.Tensor:
        """hidden [T, hidden] -> attention output [T, hidden]."""
        t = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.reshape(t, -1, self.head_dim), k.reshape(t, -1, self.head_dim)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = positions_cos_sin
        q = self.rotary_emb.apply(q, cos, sin).view(t, -1)
        k = self.rotary_emb.apply(k, cos, sin).view(t, -1)
        return self.o_proj(self.attn(q, k, v, attn_metadata))


class GemmaDecoderLayer(nn.Module):
    """Norms around both blocks: x + post_norm(attn(pre_norm(x))), then the same with the MLP."""

    def __init__(self, config: Any, layer_idx: int, layer_type: str, rotary_emb: RotaryEmbedding,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = GemmaAttention(config, layer_idx, layer_type, rotary_emb, quant_config,
                                         f"{prefix}.self_attn")
        self.mlp = GemmaMLP(config, quant_config, f"{prefix}.mlp")
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, hidden_states: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                attn_metadata: Any) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden_states), cos_sin, attn_metadata)
        hidden_states = hidden_states + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(mlp)


class GemmaModel(nn.Module):
    """Scaled embedding, decoder layers (one rotary per layer kind), final norm."""

    def __init__(self, config: Any, quant_config: QuantizationConfig | None = None, prefix: str = "model") -> None:
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention (an encoder-style Gemma) is not supported.")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                                   prefix=f"{prefix}.embed_tokens")
        self.embed_scale = config.hidden_size ** 0.5
        types = _layer_types(config)
        head_dim = hf_head_dim(config)
        # One rotary per layer kind (the same settings for both in Gemma 2).
        self.rotary_embs = nn.ModuleDict({kind: get_rope(config, head_dim, layer_type=kind) for kind in set(types)})
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, kind, self.rotary_embs[kind], quant_config, f"{prefix}.layers.{i}")
            for i, kind in enumerate(types))
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        """Token ids [T] and positions [T] -> final-normed hidden states [T, hidden]."""
        hidden_states = self.embed_tokens(input_ids)
        # The scale rounded to the model's dtype first, as Hugging Face multiplies by it.
        hidden_states = hidden_states * torch.tensor(self.embed_scale).to(hidden_states.dtype)
        cos_sin = {kind: rope.cos_sin(positions, hidden_states.dtype) for kind, rope in self.rotary_embs.items()}
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos_sin[layer.layer_type], attn_metadata)
        return self.norm(hidden_states)


class GemmaForCausalLM(CausalLM):
    """The LM of a Gemma 2 or 3 decoder, its logits soft-capped where the config says so."""

    _skip_suffixes = CausalLM._skip_suffixes + ("embed_scale",)

    def __init__(self, hf_config: Any, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(hf_config, GemmaModel(hf_config, quant_config), quant_config)
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)
        # The CPU's decode kernel (what decode graphs call) does not soft-cap attention scores.
        self.supports_decode_graphs = getattr(hf_config, "attn_logit_softcapping", None) is None

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab], soft-capped (cap * tanh(logits / cap)) where the config says so."""
        logits = super().compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Serves Gemma2ForCausalLM (gemma-2-2b, 9b, 27b)."""


class Gemma3ForCausalLM(GemmaForCausalLM):
    """Serves Gemma3ForCausalLM (the text-only Gemma 3 checkpoints, e.g. gemma-3-1b-it, gemma-3-270m)."""
