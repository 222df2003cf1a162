"""A DeepSeek-V2 GGUF file's (arch `deepseek2`) Hugging Face config, read from its `deepseek2.*` metadata.

transformers has no GGUF config mapping for DeepSeek-V2, so the whole `DeepseekV2Config` is built here from the keys
llama.cpp's converter writes. Two generations of files differ in the attention's lengths: older ones state the
expanded heads (key_length = qk_nope + qk_rope, value_length = v_head_dim, head_count_kv = heads), newer ones (which
split kv_b into attn_k_b / attn_v_b) write MLA as one KV head of the latent (key_length = kv_lora_rank + qk_rope,
value_length = kv_lora_rank) and the heads' lengths under `attention.key_length_mla` / `value_length_mla`.

What a file does not state is DeepSeek-V2's: routing by softmax, `greedy` top-k unless it states expert groups
(`group_limited_greedy`), YaRN's `mscale` equal to `mscale_all_dim` (as in every released checkpoint; the file
stores only 0.1 * mscale_all_dim, as `rope.scaling.yarn_log_multiplier`). DeepSeek-V3-style files (sigmoid gating,
a per-expert score bias `exp_probs_b`) are refused by name.
"""

from __future__ import annotations

from typing import Any

from vx.models.gguf.header import read_gguf_header

_SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that reads back to it (1e-06, not 9.99999997e-07)."""
    import numpy as np

    return float(str(np.float32(value)))


def deepseek2_config(path: str) -> Any:
    """The `DeepseekV2Config` a `deepseek2` GGUF file describes; `ValueError` naming the key for what vx cannot
    serve or the file does not state."""
    from transformers import DeepseekV2Config

    header = read_gguf_header(path, "")
    meta, tensors = header.metadata, {t.name: t for t in header.tensors}

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = meta.get(f"deepseek2.{key}", default)
        if required and value is None:
            raise ValueError(f"{path!r} does not state deepseek2.{key}, which a DeepSeek-V2 config needs.")
        return value

    if get("expert_gating_func", 1) == _SIGMOID_GATING or any(n.endswith("exp_probs_b.bias") for n in tensors):
        raise ValueError(f"{path!r} routes its experts by sigmoid with a score bias (deepseek2.expert_gating_func = "
                         "sigmoid, exp_probs_b: DeepSeek-V3's noaux_tc routing), which vx's DeepSeek-V2 does not "
                         "compute; DeepSeek-V2 routes by softmax.")
    embedding = tensors.get("token_embd.weight")
    if embedding is None or len(embedding.dims) != 2:
        raise ValueError(f"{path!r} has no 2-D token_embd.weight tensor (the vocabulary's size).")

    heads = int(get("attention.head_count", required=True))
    rope_dim = int(get("rope.dimension_count", required=True))
    key_length = int(get("attention.key_length_mla", None) or get("attention.key_length", required=True))
    value_length = int(get("attention.value_length_mla", None) or get("attention.value_length", required=True))
    if key_length <= rope_dim:
        raise ValueError(f"{path!r}: deepseek2.attention.key_length(_mla) = {key_length} leaves no non-rotary part "
                         f"beside rope.dimension_count = {rope_dim}.")
    groups = int(get("expert_group_count", 0) or 0)
    routing: dict[str, Any] = dict(topk_method="greedy", n_group=None, topk_group=None)
    if groups > 1:
        routing = dict(topk_method="group_limited_greedy", n_group=groups,
                       topk_group=int(get("expert_group_used_count", required=True)))
    rope = {"rope_type": "default", "rope_theta": _f32(get("rope.freq_base", 10000.0))}
    scaling = get("rope.scaling.type", "none")
    if scaling == "yarn":
        mscale_all_dim = float(f"{_f32(get('rope.scaling.yarn_log_multiplier', 0.0)) / 0.1:.6g}")
        rope.update(rope_type="yarn", factor=_f32(get("rope.scaling.factor", required=True)),
                    original_max_position_embeddings=int(get("rope.scaling.original_context_length",
                                                             required=True)),
                    beta_fast=_f32(get("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=_f32(get("rope.scaling.yarn_beta_slow", 1.0)),
                    mscale=mscale_all_dim, mscale_all_dim=mscale_all_dim)
    elif scaling != "none":
        raise ValueError(f"{path!r}: deepseek2.rope.scaling.type = {scaling!r} is not supported (none or yarn).")
    attention_bias = any(n.endswith((".attn_q_a.bias", ".attn_kv_a_mqa.bias", ".attn_output.bias")) for n in tensors)
    experts = int(get("expert_count", 0) or 0)

    def token(name: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{name}_token_id")
        return None if value is None else int(value)

    return DeepseekV2Config(
        vocab_size=int(embedding.dims[1]), hidden_size=int(get("embedding_length", required=True)),
        intermediate_size=int(get("feed_forward_length", required=True)),
        num_hidden_layers=int(get("block_count", required=True)), num_attention_heads=heads,
        num_key_value_heads=heads, q_lora_rank=int(get("attention.q_lora_rank", 0) or 0) or None,
        kv_lora_rank=int(get("attention.kv_lora_rank", required=True)), qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=key_length - rope_dim, v_head_dim=value_length,
        n_routed_experts=experts or None, num_experts_per_tok=int(get("expert_used_count", 0)) or None,
        n_shared_experts=int(get("expert_shared_count", 0) or 0) or None,
        moe_intermediate_size=int(get("expert_feed_forward_length", required=experts > 0) or 0),
        first_k_dense_replace=int(get("leading_dense_block_count", 0) or 0),
        routed_scaling_factor=_f32(get("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(get("expert_weights_norm", False)), **routing,
        max_position_embeddings=int(get("context_length", required=True)),
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", required=True)), rope_parameters=rope,
        attention_bias=attention_bias, tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=token("bos"), eos_token_id=token("eos"), pad_token_id=token("padding"),
    )
