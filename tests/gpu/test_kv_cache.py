"""KV-cache sizing and binding onto a model's Attention layers."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vx.gpu.attention.torch_backend import TorchAttentionBackend
from vx.gpu.attention.torch_backend import TorchAttentionImpl
from vx.gpu.kv_cache import bind_kv_caches, bytes_per_block
from vx.models.layers.attention import Attention


class _TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # Registered out of order on purpose: binding follows layer_idx.
        self.b = Attention(4, 8, 0.5, 2, layer_idx=1, sliding_window=16)
        self.a = Attention(4, 8, 0.5, 2, layer_idx=0)


def test_bytes_per_block_from_vx_or_hf_config():
    vx_like = SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=16)
    hf_like = SimpleNamespace(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    expected = 3 * 2 * 16 * 2 * 16 * 2  # layers * (k,v) * block * kv_heads * head_dim * bf16 bytes
    assert bytes_per_block(vx_like, 16, torch.bfloat16) == expected
    assert bytes_per_block(hf_like, 16, "bfloat16") == expected
    assert bytes_per_block(vx_like, 16, "float32") == 2 * expected
    with pytest.raises(ValueError, match="dtype"):
        bytes_per_block(vx_like, 16, "int3")


def test_bytes_per_block_of_mla_counts_the_latent_row():
    """DeepSeek-V2-Lite's shape: (kv_lora_rank 512 + qk_rope_head_dim 64) values per token and layer, one row (no
    K/V pair, not per head), in the model dtype."""
    from transformers import DeepseekV2Config

    from vx.gpu.attention.mla_backend import MLAAttentionBackend

    lite = DeepseekV2Config(num_hidden_layers=27, hidden_size=2048, num_attention_heads=16, q_lora_rank=None,
                            kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    assert bytes_per_block(lite, 16, "bfloat16", MLAAttentionBackend) == 27 * 16 * (512 + 64) * 2
    assert bytes_per_block(lite, 16, "float32", MLAAttentionBackend) == 27 * 16 * (512 + 64) * 4


def test_mla_layers_bind_to_the_mla_backend_only():
    from vx.gpu.attention.mla_backend import MLAAttentionBackend
    from vx.models.layers.mla import MLAAttention

    mla = nn.ModuleList([MLAAttention(4, 32, 16, 16, 16, 0.2, nn.Linear(32, 4 * 32, bias=False), layer_idx=0)])
    caches = bind_kv_caches(mla, MLAAttentionBackend, 5, 4, torch.float32, "cpu")
    assert [tuple(c.shape) for c in caches] == [(5, 4, 1, 48)]
    with pytest.raises(ValueError, match="multi-head latent attention"):
        bind_kv_caches(mla, TorchAttentionBackend, 5, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="multi-head latent attention"):
        bind_kv_caches(_TwoLayer(), MLAAttentionBackend, 5, 4, torch.float32, "cpu")


@pytest.mark.parametrize("model_dtype,auto_bytes", [("float32", 4), ("bfloat16", 2)])
def test_bytes_per_block_of_a_quantized_cache(model_dtype, auto_bytes):
    """An 8-bit cache stores a row in head_dim bytes (int8: plus its 4-byte scale) whatever the model dtype: the same
    budget holds 4x (float32) or 2x (bf16) the fp8 blocks."""
    vx_like = SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=16)
    rows = 3 * 2 * 16 * 2  # layers * (k,v) * block * kv_heads
    per = {kv: bytes_per_block(vx_like, 16, model_dtype, TorchAttentionBackend, kv)
           for kv in ("auto", "fp8_e4m3", "int8")}
    assert per == {"auto": rows * 16 * auto_bytes, "fp8_e4m3": rows * 16, "int8": rows * (16 + 4)}
    with pytest.raises(ValueError, match="Unknown kv_cache_dtype"):
        bytes_per_block(vx_like, 16, model_dtype, TorchAttentionBackend, "fp4")


@pytest.mark.parametrize("kv_cache_dtype,cache_dtype,row", [("fp8_e4m3", torch.float8_e4m3fn, 8),
                                                            ("int8", torch.int8, 12)])
def test_bind_allocates_the_format_and_tells_the_impl(kv_cache_dtype, cache_dtype, row):
    model = _TwoLayer()
    caches = bind_kv_caches(model, TorchAttentionBackend, num_blocks=5, block_size=4, dtype=torch.bfloat16,
                            device="cpu", kv_cache_dtype=kv_cache_dtype)
    assert [(c.shape, c.dtype) for c in caches] == [((2, 5, 4, 2, row), cache_dtype)] * 2
    assert all(not c.view(torch.uint8).any() for c in caches)
    assert model.a.impl.kv_format.name == model.b.impl.kv_format.name == kv_cache_dtype


def test_bind_allocates_per_layer_in_order():
    model = _TwoLayer()
    caches = bind_kv_caches(model, TorchAttentionBackend, num_blocks=5, block_size=4, dtype=torch.float32,
                            device="cpu")
    assert [c.shape for c in caches] == [(2, 5, 4, 2, 8)] * 2
    assert caches[0] is model.a.kv_cache and caches[1] is model.b.kv_cache
    assert all(not c.any() for c in caches)
    assert isinstance(model.b.impl, TorchAttentionImpl) and model.b.impl.sliding_window == 16
    assert model.a.impl.sliding_window is None and model.a.impl.num_kv_heads == 2
    assert "kv_cache" not in dict(model.named_buffers()) and not model.state_dict()


def test_bind_refuses_a_model_without_attention():
    with pytest.raises(ValueError, match="no vx Attention"):
        bind_kv_caches(nn.Linear(2, 2), TorchAttentionBackend, 1, 4, torch.float32, "cpu")


@pytest.mark.skipif(sys.platform != "linux", reason="the lazily zeroed mapping is Linux's")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_a_large_cpu_cache_is_zero_and_costs_memory_only_where_written(dtype):
    import psutil

    from vx.gpu.kv_cache import _zeroed

    shape = (2, 4096, 16, 4, 64)  # 32-128 MiB: within glibc's range, where torch.empty reused old heap memory
    rss = psutil.Process().memory_info().rss
    cache = _zeroed(shape, dtype, torch.device("cpu"))
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    cache[:, :8] = 1  # the first blocks, as the block pool hands them out
    grown = psutil.Process().memory_info().rss - rss
    assert grown < 16 * 2**20  # not the whole tensor
    assert cache[:, :8].float().eq(1).all() and not cache[:, 8:].float().any()
