"""Llama-family decoder: Llama, Mistral, Qwen2 and Qwen3 share this one implementation.

Differences are read from the Hugging Face config: Qwen2 always has q/k/v bias, Qwen3 has per-head
q/k RMSNorm and an explicit head_dim, Llama may have `attention_bias` / `mlp_bias`, Mistral (and Qwen with
`use_sliding_window`) has a sliding window. Tokens of the whole batch arrive flattened ([T]), no batch dim. A rank of
several builds only its shard (`tp_group`) and its pipeline stage's layers (`pp_group`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from vx.config import hf_head_dim, hf_num_kv_heads
from vx.distributed.parallel_state import pp_layer_range
from vx.models.causal_lm import CausalLM
from vx.models.layers.activation import SiluAndMul
from vx.models.layers.attention import Attention
from vx.models.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vx.models.layers.norm import RMSNorm
from vx.models.layers.quantization import QuantizationConfig
from vx.models.layers.rotary import RotaryEmbedding, get_rope
from vx.models.layers.vocab_embedding import VocabParallelEmbedding
from vx.models.registry import architecture_of

if TYPE_CHECKING:
    from vx.distributed import GroupCoordinator


def _sliding_window(config: Any, layer_idx: int) -> int | None:
    """The layer's window, or None; `layer_types` (Qwen2/3) can leave some layers at full attention."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    return int(window)


class LlamaMLP(nn.Module):
    """SwiGLU MLP with gate and up projections fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 tp_group: GroupCoordinator | None = None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj",
                                                       tp_group=tp_group)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj", tp_group=tp_group)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x))."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """Self-attention block: fused qkv projection, optional q/k norm, rotary, paged attention, o_proj."""

    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 tp_group: GroupCoordinator | None = None) -> None:
        super().__init__()
        row = architecture_of(config)  # the architecture's quirks (none for a config type vx has no row for)
        self.head_dim = hf_head_dim(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = hf_num_kv_heads(config)
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = row.qkv_bias if row is not None and row.qkv_bias is not None else attention_bias
        o_bias = row.o_bias if row is not None and row.o_bias is not None else attention_bias
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads,
                                          bias=qkv_bias, quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
                                          tp_group=tp_group)
        self.o_proj = RowParallelLinear(self.num_heads * self.head_dim, config.hidden_size, bias=o_bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj", tp_group=tp_group)
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.use_qk_norm = row is not None and row.qk_norm
        if self.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        # Shared module, held as a plain attribute so it is not registered once per layer.
        self.__dict__["rotary_emb"] = rotary_emb
        self.attn = Attention(self.qkv_proj.num_heads, self.head_dim, self.head_dim ** -0.5,
                              self.qkv_proj.num_kv_heads, layer_idx=layer_idx,
                              sliding_window=_sliding_window(config, layer_idx))

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        """hidden [T, hidden] -> attention output [T, hidden]; cos/sin come from the model's rotary."""
        t = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, -1, self.head_dim)
        k = k.view(t, -1, self.head_dim)
        if self.use_qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = self.rotary_emb.apply(q, cos, sin).view(t, -1)
        k = self.rotary_emb.apply(k, cos, sin).view(t, -1)
        return self.o_proj(self.attn(q, k, v, attn_metadata))


class PreNormDecoderLayer(nn.Module):
    """A pre-norm decoder layer's forward over its `input_layernorm`, `self_attn`, `post_attention_layernorm` and
    `mlp` (each family builds its own); the residual add is fused into the next norm."""

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual); the caller adds them (in the next layer's or the final norm)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, cos, sin, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaDecoderLayer(PreNormDecoderLayer):
    """Pre-norm decoder layer of the Llama family."""

    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", mlp: nn.Module | None = None,
                 tp_group: GroupCoordinator | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, rotary_emb, quant_config, f"{prefix}.self_attn",
                                        tp_group)
        self.mlp = mlp if mlp is not None else LlamaMLP(
            config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)), quant_config,
            f"{prefix}.mlp", tp_group)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm; `mlp_for_layer(layer_idx, prefix)` gives a layer another MLP (the
    experts of a mixture-of-experts family), or None for the dense one.

    With a `pp_group` of several stages this rank builds only its stage's layers (`pp_layer_range`), the embedding
    on the first stage and the final norm on the last; the other layers are `PPMissingLayer`s, so that parameter
    names keep their layer numbers. A stage that is not the first takes the previous one's (hidden, residual)
    stacked as `intermediate` [2, T, hidden]; one that is not the last returns the same for the next.
    """

    def __init__(self, config: Any, quant_config: QuantizationConfig | None = None, prefix: str = "model",
                 mlp_for_layer: Callable[[int, str], nn.Module | None] | None = None,
                 tp_group: GroupCoordinator | None = None, pp_group: GroupCoordinator | None = None) -> None:
        super().__init__()
        self.is_first_stage = pp_group is None or pp_group.is_first_rank
        self.is_last_stage = pp_group is None or pp_group.is_last_rank
        num_layers = config.num_hidden_layers
        self.start_layer, self.end_layer = (0, num_layers) if pp_group is None else pp_layer_range(
            num_layers, pp_group.rank_in_group, pp_group.world_size)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                                   prefix=f"{prefix}.embed_tokens", tp_group=tp_group) \
            if self.is_first_stage else PPMissingLayer()
        self.rotary_emb = get_rope(config, hf_head_dim(config))
        mlp_for_layer = mlp_for_layer or (lambda layer_idx, mlp_prefix: None)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary_emb, quant_config, f"{prefix}.layers.{i}",
                              mlp_for_layer(i, f"{prefix}.layers.{i}.mlp"), tp_group)
            if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(num_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if self.is_last_stage else PPMissingLayer()
        # Checkpoint names this stage has no parameter for: the other stages' (skipped quietly when loading).
        self.missing_prefixes = tuple(f"{prefix}.{name}." for name, module in self.named_children()
                                      if isinstance(module, PPMissingLayer)) + tuple(
            f"{prefix}.layers.{i}." for i in range(num_layers) if not self.start_layer <= i < self.end_layer)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any,
                intermediate: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [T] and positions [T] -> final-normed hidden states [T, hidden] (on the last stage; on the
        others, (hidden, residual) stacked [2, T, hidden] for the next stage)."""
        if self.is_first_stage:
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:
            hidden_states, residual = intermediate[0], intermediate[1]
        cos, sin = self.rotary_emb.cos_sin(positions, hidden_states.dtype)
        for layer in self.layers[self.start_layer:self.end_layer]:
            hidden_states, residual = layer(hidden_states, residual, cos, sin, attn_metadata)
        if not self.is_last_stage:
            return torch.stack([hidden_states, residual])
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class PPMissingLayer(nn.Identity):
    """The place of a module another pipeline stage holds: no parameters, never called."""


class LlamaForCausalLM(CausalLM):
    """Causal LM head on `LlamaModel`; serves LlamaForCausalLM, MistralForCausalLM, Qwen2/Qwen3ForCausalLM. With a
    `tp_group`, every layer holds this rank's shard (heads, intermediate features, vocabulary rows)."""

    def __init__(self, hf_config: Any, quant_config: QuantizationConfig | None = None,
                 tp_group: GroupCoordinator | None = None, pp_group: GroupCoordinator | None = None) -> None:
        super().__init__(hf_config, LlamaModel(hf_config, quant_config, tp_group=tp_group, pp_group=pp_group),
                         quant_config, tp_group=tp_group)
