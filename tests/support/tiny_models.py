"""Tiny random Hugging Face models of each supported family, saved as safetensors (the models tests and the session fixtures in tests/conftest.py).

Weights use a large initializer_range so logits are peaked: greedy decoding is then stable enough to
compare token for token.
"""

from __future__ import annotations

import os
from typing import Any

import torch

FAMILIES = ("llama", "llama3_tied", "mistral", "qwen2", "qwen3", "qwen3_yarn", "phi3", "gemma2", "gemma3", "qwen3_moe",
            "mixtral", "deepseek_v2", "deepseek_v2_qlora_yarn")
# The families every engine-level test runs (a session fixture each): one per model class and weight layout.
ENGINE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3_moe", "mixtral",
                   "deepseek_v2")

_COMMON: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.25, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
)

_FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": dict(num_hidden_layers=3, attention_bias=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # Llama 3.1-style rope scaling with a short original context so the scaling actually bites.
    "llama3_tied": dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # A window shorter than the test prompts, to prove it is honoured.
    "mistral": dict(sliding_window=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # Sliding window on layers >= max_window_layers only: checks the per-layer `layer_types` handling.
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Explicit head_dim different from hidden/heads, as real Qwen3 checkpoints have.
    "qwen3": dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Qwen3's long-context setting: YaRN over a short original context.
    "qwen3_yarn": dict(head_dim=32, max_position_embeddings=128, rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                                     "original_max_position_embeddings": 32}),
    # Phi-4-mini's shape: fused qkv and gate_up weights, a partial rotary factor, LongRoPE, tied embeddings. The
    # original context (96) holds the tests' prompts and answers: a sequence growing past it is re-encoded with the
    # long factors by Hugging Face's Phi-3 `generate` and rotated position by position by vx (vx/models/
    # layers/rotary.py), so token equality holds within it; the long factors are checked in the rotary's tests.
    "phi3": dict(tie_word_embeddings=True, partial_rotary_factor=0.75, original_max_position_embeddings=96,
                 max_position_embeddings=1024, sliding_window=None,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                  "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                  "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}),
    # Gemma 2: sliding (window 8) and global layers, attention scores and final logits soft-capped low enough that
    # the caps bite on these weights.
    "gemma2": dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=True,
                   attn_logit_softcapping=5.0, final_logit_softcapping=10.0, hidden_activation="gelu_pytorch_tanh",
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # Gemma 3: sliding (window 8, shorter than the prompts) and global layers, each kind with its own rope base
    # (the global one linearly scaled, as in the 4B+ models), q/k norms, soft-capped final logits.
    "gemma3": dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=True,
                   final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                                       "factor": 8.0}}),
    # Mixture-of-experts: 4 experts, 2 per token; Qwen3-MoE with one dense layer (mlp_only_layers) among the sparse
    # ones and renormalised top-k weights, Mixtral with a window shorter than the prompts.
    "qwen3_moe": dict(num_hidden_layers=3, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # DeepSeek-V2-Lite's shape scaled down: MLA without a q low-rank (kv_lora_rank 32, rope 16, nope 16, v 16, 4
    # heads), a dense first layer (first_k_dense_replace=1), then 8 routed experts in 4 groups (top 3 of the best 2
    # groups: unlike a top 2, that differs from a plain top 3 whenever the best 3 span 3 groups), a shared expert and
    # a routed scaling factor.
    "deepseek_v2": dict(num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
                        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8,
                        num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=1,
                        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
                        first_k_dense_replace=1, norm_topk_prob=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # DeepSeek-V2's full form: a q low-rank (q_a_proj, q_a_layernorm, q_b_proj), biases, plain greedy top-k, and YaRN
    # with mscale / mscale_all_dim over a short original context (the softmax scale takes mscale^2).
    "deepseek_v2_qlora_yarn": dict(
        num_hidden_layers=2, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=2, topk_method="greedy", routed_scaling_factor=1.0, first_k_dense_replace=1,
        attention_bias=True, max_position_embeddings=256, norm_topk_prob=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 0.707, "mscale_all_dim": 0.707}),
}


def make_tiny_config(family: str, **overrides: Any) -> Any:
    """The transformers config of a tiny model of `family` (see FAMILIES)."""
    from transformers import (DeepseekV2Config, Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig,
                              Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

    classes = {"llama": LlamaConfig, "llama3_tied": LlamaConfig, "mistral": MistralConfig,
               "qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_yarn": Qwen3Config, "phi3": Phi3Config,
               "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig, "qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig,
               "deepseek_v2": DeepseekV2Config, "deepseek_v2_qlora_yarn": DeepseekV2Config}
    if family not in classes:
        raise ValueError(f"Unknown tiny model family {family!r}; choose from {FAMILIES}.")
    kwargs = {**_COMMON, **_FAMILY_OVERRIDES[family], **overrides}
    return classes[family](**kwargs)


def make_tiny_hf_model(family: str, seed: int = 0, **overrides: Any) -> Any:
    """A float32 eval-mode Hugging Face model with seeded random weights."""
    from transformers import AutoModelForCausalLM

    config = make_tiny_config(family, **overrides)
    config._attn_implementation = "eager"  # plain reference math
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # HF initialises norms to 1 and biases to 0; randomise them so a mis-loaded one cannot go unnoticed.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.25 * torch.randn_like(p))
    return model.eval()


def make_tiny_model(family: str, dirpath: str | os.PathLike, seed: int = 0, return_hf: bool = False,
                    **overrides: Any) -> Any:
    """Save a tiny random `family` model (config.json + model.safetensors) in `dirpath`; returns the path.

    With return_hf=True returns (path, hf_model) so callers can compare against the same weights.
    """
    model = make_tiny_hf_model(family, seed=seed, **overrides)
    path = os.fspath(dirpath)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return (path, model) if return_hf else path


def greedy_prompts(vocab: int = 400) -> list[list[int]]:
    """The prompts greedy decoding is compared on (against Hugging Face, on another device): 10 seeded ones of mixed
    lengths (1 to 61 tokens), four of them sharing a 45-token prefix, so that prefix caching, windows and chunks
    are crossed."""
    import random

    rng = random.Random(1234)
    shared = [rng.randrange(1, vocab) for _ in range(45)]
    prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in (1, 3, 9, 17, 33, 60)]
    prompts += [shared + [rng.randrange(1, vocab) for _ in range(k)] for k in (2, 7, 16)]
    prompts.append(list(shared))
    return prompts
