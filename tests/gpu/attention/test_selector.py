"""The backend registry, the interface the selector relies on, and the pieces every backend shares."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from vx.config import EngineArgs
from vx.gpu.attention import (AttentionBackend, AttentionImpl, CommonAttentionMetadata, KVCacheWrite,
                              get_attn_backend, load_backend)
from vx.gpu.attention.backend import slot_views
from vx.gpu.attention.registry import ATTENTION_BACKEND_NAMES, AUTO, BACKENDS


@pytest.mark.parametrize("name", sorted(b.name for b in BACKENDS))
def test_each_registered_backend_loads_under_its_name(name):
    cls = load_backend(name)
    assert issubclass(cls, AttentionBackend) and cls.get_name() == name
    # Keys and values; MLA caches one latent row per token instead.
    assert cls.get_kv_cache_shape(3, 4, 2, 8) == ((3, 4, 2, 8) if cls.is_mla else (2, 3, 4, 2, 8))
    assert cls.is_mla == (name == "mla")


def test_unknown_name_lists_the_registry():
    with pytest.raises(ValueError, match="choose one of: auto, torch, cpu, triton, flash_attn"):
        get_attn_backend("xformers", "cpu")


def test_config_accepts_exactly_the_registered_names():
    for name in ATTENTION_BACKEND_NAMES:
        EngineArgs(attention_backend=name)._check_scalars()
    assert ATTENTION_BACKEND_NAMES[0] == AUTO
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineArgs(attention_backend="xformers")._check_scalars()


def test_importing_the_package_loads_no_backend():
    code = ("import sys, vx.gpu.attention, vx.config, vx.gpu.attention.registry; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('triton', 'flash_attn') "
            "or m.startswith('vx.') and m.endswith(('_backend', '_kernels'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    code = "import sys, vx.config, vx.gpu.attention.registry; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


class _Minimal(AttentionBackend):
    """A backend that declares only what the interface requires."""

    @staticmethod
    def get_name() -> str:
        return "minimal"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        raise NotImplementedError

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> Any:
        return common


def test_interface_defaults():
    assert _Minimal.get_kv_cache_shape(5, 16, 2, 64) == (2, 5, 16, 2, 64)
    assert _Minimal.unavailable_reason("cuda") is None
    assert _Minimal.unsupported_reason(dtype=torch.int8, head_dim=1000, block_size=3) is None
    assert _Minimal.is_paged(16)
    # A backend reads a quantized cache only if it says so: by default it refuses one.
    assert _Minimal.unsupported_reason(kv_cache_dtype="auto") is None
    assert "reads no fp8_e4m3 KV cache" in _Minimal.unsupported_reason(kv_cache_dtype="fp8_e4m3")


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_a_quantized_cache_steers_the_selection(monkeypatch, kv_cache_dtype):
    """flash_attn (FA2) reads no quantized cache: named, it is refused saying so; under 'auto' triton takes over,
    and torch when triton cannot run."""
    from vx.gpu.attention.flash_attn_backend import FlashAttnBackend
    from vx.gpu.attention.triton_backend import TritonAttentionBackend
    from vx.gpu.attention.torch_backend import TorchAttentionBackend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(FlashAttnBackend, "unavailable_reason", staticmethod(lambda device: None))
    shape = dict(dtype=torch.bfloat16, head_dim=128, block_size=256)
    assert get_attn_backend("auto", "cuda", **shape, kv_cache_dtype="auto") is FlashAttnBackend
    assert get_attn_backend("auto", "cuda", **shape, kv_cache_dtype=kv_cache_dtype) is TritonAttentionBackend
    with pytest.raises(ValueError, match=f"flash_attn'? is unavailable: FlashAttention-2 reads no {kv_cache_dtype} "
                                         "KV cache .*use attention_backend='triton' or 'torch'"):
        get_attn_backend("flash_attn", "cuda", **shape, kv_cache_dtype=kv_cache_dtype)
    monkeypatch.setattr(TritonAttentionBackend, "unavailable_reason", staticmethod(lambda device: "no"))
    assert get_attn_backend("auto", "cuda", **shape, kv_cache_dtype=kv_cache_dtype) is TorchAttentionBackend


def test_an_int8_cache_needs_head_dim_divisible_by_4():
    for name in ("torch", "cpu"):
        assert get_attn_backend(name, "cpu", head_dim=64, kv_cache_dtype="int8").get_name() == name
        with pytest.raises(ValueError, match="int8 KV cache needs head_dim divisible by 4, got 30"):
            get_attn_backend(name, "cpu", head_dim=30, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="'auto' found no backend: even torch cannot serve this"):
        get_attn_backend("auto", "cpu", head_dim=30, kv_cache_dtype="int8")
    assert get_attn_backend("auto", "cpu", head_dim=30, kv_cache_dtype="fp8_e4m3") is not None


def _common(slot_mapping: list[int], num_actual_tokens: int) -> CommonAttentionMetadata:
    qsl = torch.tensor([0, num_actual_tokens], dtype=torch.int32)
    seq = torch.tensor([num_actual_tokens], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, seq_lens_cpu=seq,
        block_table=torch.zeros(1, 2, dtype=torch.int32), slot_mapping=torch.tensor(slot_mapping),
        num_reqs=1, num_actual_tokens=num_actual_tokens, max_query_len=num_actual_tokens,
        max_seq_len=num_actual_tokens, block_size=4)


@pytest.mark.parametrize("slot_mapping,num_actual,written", [
    ([5, 2, 7, -1, -1], 3, {5: 0, 2: 1, 7: 2}),   # padding past the actual tokens
    ([5, -1, 7, 1, -1], 4, {5: 0, 7: 2, 1: 3}),   # a skipped slot among them
])
def test_kv_cache_write_stores_actual_tokens_only(slot_mapping, num_actual, written):
    write = KVCacheWrite.from_common(_common(slot_mapping, num_actual))
    assert (write.rows is None) == (-1 not in slot_mapping[:num_actual])
    cache = torch.full((2, 2, 4, 1, 2), 99.0)
    k = torch.arange(len(slot_mapping), dtype=torch.float32)[:, None, None].expand(-1, 1, 2)
    key_slots, value_slots = slot_views(cache)
    write.apply(key_slots, value_slots, k, -k)
    assert key_slots.data_ptr() == cache.data_ptr()
    for slot in range(8):
        want = float(written[slot]) if slot in written else 99.0
        assert key_slots[slot].flatten().tolist() == [want, want]
        assert value_slots[slot].flatten().tolist() == [-want if slot in written else 99.0] * 2


def test_new_output_zeroes_padding_rows_only():
    class _Impl(AttentionImpl):
        def forward(self, layer, q, k, v, kv_cache, attn_metadata):
            raise NotImplementedError

    impl = _Impl(num_heads=2, head_dim=3, scale=1.0, num_kv_heads=1)
    out = impl.new_output(torch.ones(5, 6, dtype=torch.float16), num_actual_tokens=3)
    assert out.shape == (5, 6) and out.dtype == torch.float16
    assert not out[3:].any()


def test_soft_capped_models_pass_over_backends_that_cannot_cap(monkeypatch):
    """Gemma 2 on CUDA: 'auto' skips flash_attn (vx does not pass it the soft cap) for triton, and naming flash_attn
    says why. Before, 'auto' picked a backend that refused the model when its layers were built."""
    from vx.gpu.attention.flash_attn_backend import FlashAttnBackend
    from vx.gpu.attention.triton_backend import TritonAttentionBackend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(FlashAttnBackend, "unavailable_reason", staticmethod(lambda device: None))
    monkeypatch.setattr(TritonAttentionBackend, "unavailable_reason", staticmethod(lambda device: None))
    shape = dict(dtype=torch.bfloat16, head_dim=128, block_size=256)
    assert get_attn_backend("auto", "cuda", **shape) is FlashAttnBackend
    assert get_attn_backend("auto", "cuda", **shape, logits_soft_cap=True) is TritonAttentionBackend
    with pytest.raises(ValueError, match="flash_attn'? is unavailable: it does not apply attention-logit soft-capping"):
        get_attn_backend("flash_attn", "cuda", **shape, logits_soft_cap=True)
