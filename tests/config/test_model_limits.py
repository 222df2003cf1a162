"""vx.config.model_limits: every real model's shape and every tiny test model lies within the ranges; a field
outside its range, a NaN or infinity anywhere, a non-positive epsilon or rope base, heads that do not divide what they
must are a ValueError naming the field and its value. The weight count it derives is a lower bound of the model's."""

from __future__ import annotations

import math

import pytest
from tests.support.tiny_models import FAMILIES, make_tiny_config, make_tiny_hf_model

from vx.config.model_limits import check_model_config, min_weight_count

# Real models' shapes as their config.json states them, with their parameter counts (their files' weights).
REAL_MODELS = {
    "Llama-3.1-405B": (dict(num_hidden_layers=126, hidden_size=16384, intermediate_size=53248, num_attention_heads=128,
                            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                            rms_norm_eps=1e-5, rope_theta=500000.0,
                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
                       405.8e9),
    "DeepSeek-V3": (dict(num_hidden_layers=61, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                         num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
                         num_experts_per_tok=8, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                         qk_nope_head_dim=128, v_head_dim=128, vocab_size=129280, max_position_embeddings=163840,
                         rms_norm_eps=1e-6, rope_theta=10000, routed_scaling_factor=2.5,
                         rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                       "original_max_position_embeddings": 4096}),
                    671e9),
    "Gemma-3-27B": (dict(num_hidden_layers=62, hidden_size=5376, intermediate_size=21504, num_attention_heads=32,
                         num_key_value_heads=16, head_dim=128, vocab_size=262208, max_position_embeddings=131072,
                         rms_norm_eps=1e-6, query_pre_attn_scalar=168, sliding_window=1024,
                         rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                          "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                                             "factor": 8.0}}),
                    27.009e9),  # the text model (its vision tower aside)
    "Qwen3-235B-A22B": (dict(num_hidden_layers=94, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                             num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
                             num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=40960,
                             rms_norm_eps=1e-6, rope_theta=1000000.0),
                        235e9),
    "Llama-4-Scout (10M context)": (dict(num_hidden_layers=48, hidden_size=5120, intermediate_size=8192,
                                         num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                                         num_local_experts=16, num_experts_per_tok=1, vocab_size=202048,
                                         max_position_embeddings=10485760, rms_norm_eps=1e-5, rope_theta=500000.0),
                                    109e9),
    "SmolLM2-135M": (dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                          num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                          rope_theta=100000.0, tie_word_embeddings=True),
                     134.5e6),
    "Phi-4-mini": (dict(num_hidden_layers=32, hidden_size=3072, intermediate_size=8192, num_attention_heads=24,
                        num_key_value_heads=8, vocab_size=200064, max_position_embeddings=131072,
                        partial_rotary_factor=0.75, rms_norm_eps=1e-5, sliding_window=262144,
                        rope_scaling={"type": "longrope", "long_factor": [1.0, 1.1], "short_factor": [1.0, 1.0]}),
                   3.84e9),
}


@pytest.mark.parametrize("name", list(REAL_MODELS))
def test_real_models_are_within_range_and_their_weights_above_the_bound(name):
    config, params = REAL_MODELS[name]
    check_model_config(config, name)
    assert min_weight_count(config) <= params
    if not any(key in config for key in ("n_routed_experts", "num_experts", "num_local_experts")):
        assert min_weight_count(config) > 0.99 * params  # a mixture of experts counts its smallest MLP only


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tiny_model_is_within_range_and_holds_at_least_the_bound(family):
    model = make_tiny_hf_model(family)
    check_model_config(model.config, family)
    assert 0 < min_weight_count(model.config) <= sum(p.numel() for p in model.parameters())


BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


@pytest.mark.parametrize("change, message", [
    (dict(num_hidden_layers=10**9), "num_hidden_layers=1000000000 is out of range (vx accepts 1 to 1024)"),
    (dict(num_hidden_layers=0), "num_hidden_layers=0 is out of range"),
    (dict(num_attention_heads=0), "num_attention_heads=0 is out of range"),
    (dict(num_key_value_heads=0), "num_key_value_heads=0 is out of range"),
    (dict(hidden_size=-64), "hidden_size=-64 is out of range (vx accepts 1 to 131072)"),
    (dict(vocab_size=0), "vocab_size=0 is out of range (vx accepts 1 to 2097152)"),
    (dict(vocab_size=5_000_000), "vocab_size=5000000 is out of range"),
    (dict(intermediate_size=1 << 30), "intermediate_size=1073741824 is out of range"),
    (dict(head_dim=1 << 20), "head_dim=1048576 is out of range"),
    (dict(max_position_embeddings=10**12), "max_position_embeddings=1000000000000 is out of range"),
    (dict(num_hidden_layers=2.5), "num_hidden_layers=2.5 is not an integer"),
    (dict(num_hidden_layers=True), "num_hidden_layers=True is not an integer"),
    (dict(hidden_size="64"), "hidden_size='64' is not an integer"),
    (dict(rms_norm_eps=math.nan), "rms_norm_eps=nan is not a finite number"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps=0.0 must be positive and at most 1.0"),
    (dict(rms_norm_eps=-1e-6), "rms_norm_eps=-1e-06 must be positive"),
    (dict(rms_norm_eps="small"), "rms_norm_eps='small' is not a number"),
    (dict(rope_theta=math.inf), "rope_theta=inf is not a finite number"),
    (dict(rope_theta=0), "rope_theta=0 must be positive"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": -1.0}),
     "rope_parameters's rope_theta=-1.0 must be positive"),
    (dict(rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 0.0}}),
     "rope_parameters's factor=0.0 must be positive"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "long_factor": [1.0, math.nan]}),
     "rope_parameters.long_factor.1=nan is not a finite number"),
    (dict(initializer_range=math.nan), "initializer_range=nan is not a finite number"),
    (dict(num_key_value_heads=3), "num_key_value_heads=3 does not divide num_attention_heads=4"),
    (dict(hidden_size=66), "hidden_size=66 is not a multiple of num_attention_heads=4 (no head_dim is given)"),
    (dict(num_local_experts=4, num_experts_per_tok=5), "num_experts_per_tok=5 is more than the 4 experts"),
    (dict(partial_rotary_factor=1.5), "partial_rotary_factor=1.5 must be positive and at most 1.0"),
])
def test_a_bad_field_is_refused_naming_it_and_its_value(change, message):
    with pytest.raises(ValueError, match=f"^m/config.json: {message}".replace("(", r"\(").replace(")", r"\)")
                       .replace(".", r"\.")):
        check_model_config({**BASE, **change}, "m/config.json")


def test_absent_fields_are_left_to_their_defaults_and_explicit_head_dims_need_not_divide():
    check_model_config({"vocab_size": 10, "num_key_value_heads": None, "head_dim": None}, "m")
    check_model_config({**BASE, "hidden_size": 66, "head_dim": 16}, "m")  # Qwen3 and Gemma state head_dim
    check_model_config(make_tiny_config("qwen3", hidden_size=66, head_dim=16), "m")  # a transformers config


def test_a_field_is_named_as_its_file_names_it():
    with pytest.raises(ValueError, match=r"^f\.gguf: llama\.block_count=0 is out of range"):
        check_model_config({"num_hidden_layers": 0}, "f.gguf", {"num_hidden_layers": "llama.block_count"})
