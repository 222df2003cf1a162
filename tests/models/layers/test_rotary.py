"""Rotary embedding: inverse frequencies and cos/sin equal Hugging Face's, for every supported rope type."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tests.support.tiny_models import make_tiny_config

from vx.models.layers.rotary import RotaryEmbedding, compute_inv_freq, get_rope, get_rope_config

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _hf_inv_freq(config) -> torch.Tensor:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, "cpu")[0]


@pytest.mark.parametrize("params", [
    LLAMA3,
    {**LLAMA3, "original_max_position_embeddings": 8192, "rope_theta": 10000.0, "factor": 32.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
])
def test_scaled_inv_freq_equals_hf(params):
    config = make_tiny_config("llama", head_dim=64, rope_parameters=dict(params))
    ours = compute_inv_freq(64, get_rope_config(config))
    torch.testing.assert_close(ours, _hf_inv_freq(config), atol=0, rtol=0)


def test_llama3_cos_sin_equal_hf_rotary():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = make_tiny_config("llama3_tied")
    head_dim = config.hidden_size // config.num_attention_heads
    ours = get_rope(config, head_dim)
    positions = torch.tensor([0, 1, 5, 63, 64, 65, 500, 1023])
    cos_hf, sin_hf = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = ours.cos_sin(positions, torch.float32)
    half = head_dim // 2
    torch.testing.assert_close(cos[:, 0], cos_hf[0], atol=1e-6, rtol=0)
    # Our sin table carries rotate_half's sign on its first half.
    torch.testing.assert_close(sin[:, 0, half:], sin_hf[0, :, half:], atol=1e-6, rtol=0)
    torch.testing.assert_close(-sin[:, 0, :half], sin_hf[0, :, :half], atol=1e-6, rtol=0)


def test_apply_equals_hf_apply_rotary_pos_emb():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = make_tiny_config("llama3_tied")
    head_dim = config.hidden_size // config.num_attention_heads
    positions = torch.arange(0, 300, 7)
    q = torch.randn(len(positions), 4, head_dim)
    k = torch.randn(len(positions), 2, head_dim)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_ours, k_ours = get_rope(config, head_dim)(positions, q.reshape(len(positions), -1),
                                                k.reshape(len(positions), -1))
    torch.testing.assert_close(q_ours.view_as(q), q_hf[0].transpose(0, 1), atol=1e-6, rtol=0)
    torch.testing.assert_close(k_ours.view_as(k), k_hf[0].transpose(0, 1), atol=1e-6, rtol=0)


def test_old_style_config_equals_rope_parameters():
    """rope_theta + rope_scaling attributes (pre-transformers-5 configs) read the same as rope_parameters."""
    old = SimpleNamespace(rope_theta=500000.0, max_position_embeddings=1024, rope_scaling={
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    new = make_tiny_config("llama3_tied")
    torch.testing.assert_close(compute_inv_freq(16, get_rope_config(old)), compute_inv_freq(16, get_rope_config(new)))
    plain = get_rope_config(SimpleNamespace(max_position_embeddings=8))
    assert plain.rope_type == "default" and plain.theta == 10000.0


def test_partial_rotary_leaves_the_tail_alone():
    cfg = SimpleNamespace(max_position_embeddings=32, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    rope = get_rope(cfg, 16)
    assert rope.rotary_dim == 8
    x = torch.randn(5, 2 * 16)
    q, _ = rope(torch.arange(5), x, x)
    torch.testing.assert_close(q.view(5, 2, 16)[..., 8:], x.view(5, 2, 16)[..., 8:])
    assert not torch.allclose(q.view(5, 2, 16)[1:, :, :8], x.view(5, 2, 16)[1:, :, :8])


def test_unsupported_rope_type_is_refused():
    cfg = SimpleNamespace(max_position_embeddings=32, rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="dynamic"):
        get_rope(cfg, 16)
    with pytest.raises(ValueError, match="longrope"):  # the message lists what is supported
        RotaryEmbedding(16, get_rope_config(cfg), 32)


def _assert_cos_sin_equal(ours: RotaryEmbedding, cos_hf: torch.Tensor, sin_hf: torch.Tensor,
                          positions: torch.Tensor) -> None:
    cos, sin = ours.cos_sin(positions, torch.float32)
    half = ours.rotary_dim // 2
    torch.testing.assert_close(cos[:, 0], cos_hf, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[:, 0, half:], sin_hf[:, half:], atol=1e-6, rtol=0)
    torch.testing.assert_close(-sin[:, 0, :half], sin_hf[:, :half], atol=1e-6, rtol=0)


@pytest.mark.parametrize("params", [
    {},  # the tiny family's: factor 4 over 32 original positions
    {"factor": 8.0, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {"mscale": 1.0, "mscale_all_dim": 0.5},
    {"attention_factor": 1.25},
])
def test_yarn_cos_sin_equal_hf(params):
    """YaRN's ramped frequencies and attention factor, as Qwen3's long-context config sets them."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    base = make_tiny_config("qwen3_yarn")
    config = make_tiny_config("qwen3_yarn", rope_parameters={**base.rope_parameters, **params})
    positions = torch.tensor([0, 1, 7, 31, 32, 33, 100, 127])
    cos_hf, sin_hf = Qwen3RotaryEmbedding(config)(torch.zeros(1), positions[None])
    _assert_cos_sin_equal(get_rope(config, 32), cos_hf[0], sin_hf[0], positions)


def test_longrope_uses_short_factors_within_the_original_context_and_long_ones_past_it():
    """Position by position, what Hugging Face's Phi-3 rotary gives a sequence that ends at that position:
    the short set (times the attention factor) up to the original length, the long set past it."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = make_tiny_config("phi3")
    head_dim = config.hidden_size // config.num_attention_heads
    ours = get_rope(config, head_dim)
    assert ours.rotary_dim == 12
    for position in (0, 5, 95, 96, 97, 300, 1023):
        hf = Phi3RotaryEmbedding(config)
        cos_hf, sin_hf = hf(torch.zeros(1), torch.arange(position + 1)[None])
        at = torch.tensor([position])
        _assert_cos_sin_equal(ours, cos_hf[0, -1:], sin_hf[0, -1:], at)


@pytest.mark.parametrize("rope_scaling", [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
     "original_max_position_embeddings": 64},
], ids=lambda r: (r or {}).get("rope_type", "default"))
def test_rope_frequencies_build_under_another_default_device(rope_scaling):
    """Models are built under the target device as torch's default (CUDA on a GPU): every rope type computes its
    frequencies on the CPU and moves them, rather than mixing devices (LongRoPE did, on the GPU)."""
    from transformers import LlamaConfig

    from vx.models.layers.rotary import get_rope

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                         rope_scaling=rope_scaling)
    with torch.device("meta"):
        rope = get_rope(config, 16)
    buffers = list(rope.buffers())
    assert buffers and all(b.device.type == "meta" for b in buffers)


def test_rope_memory_does_not_grow_with_the_context_length():
    """A 128k-context model's rotary embedding holds its frequencies, not cos and sin for every position (a table
    of 2 x 131072 x 128 float32 would be 128 MiB resident for the engine's life); positions past the configured
    context still rotate, as Hugging Face computes them."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from vx.models.layers.rotary import get_rope

    config = LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=131072)
    rope = get_rope(config, 128)
    assert sum(b.nbytes for b in rope.buffers()) <= 1024
    positions = torch.tensor([0, 1, 131071, 140000])
    cos_hf, sin_hf = LlamaRotaryEmbedding(config)(torch.zeros(1), positions[None])
    _assert_cos_sin_equal(rope, cos_hf[0], sin_hf[0], positions)
