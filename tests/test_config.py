"""vx/config.py: the model facts read from a Hugging Face config and model-directory JSON files; the
request-isolation limits (max_n_sequences, grammar compile limits), validated and landing in one config place each."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vx.config import EngineArgs, ModelConfig, default_grammar_compile_workers, hf_head_dim, hf_num_kv_heads, read_json


@pytest.mark.parametrize("fields,kv_heads,head_dim", [
    (dict(num_attention_heads=8, hidden_size=512), 8, 64),                               # no GQA
    (dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=512), 2, 64),       # GQA
    (dict(num_attention_heads=16, num_key_value_heads=8, hidden_size=1024, head_dim=128), 8, 128),  # Qwen3
    (dict(num_attention_heads=8, num_key_value_heads=None, hidden_size=512, head_dim=None), 8, 64),
])
def test_head_rules(fields, kv_heads, head_dim):
    hf = SimpleNamespace(**fields)
    assert (hf_num_kv_heads(hf), hf_head_dim(hf)) == (kv_heads, head_dim)
    mc = ModelConfig(model="m", tokenizer="m", hf_config=hf, architecture="LlamaForCausalLM", dtype="float32",
                     max_model_len=16, vocab_size=10, eos_token_ids=[])
    assert (mc.num_kv_heads, mc.head_dim) == (kv_heads, head_dim)


def test_read_json(tmp_path):
    (tmp_path / "ok.json").write_text('{"a": 1}', encoding="utf-8")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bad.json").write_text("{")
    assert read_json(str(tmp_path / "ok.json")) == {"a": 1}
    for name in ("list.json", "bad.json", "missing.json"):
        assert read_json(str(tmp_path / name)) == {}


@pytest.mark.parametrize("name, value", [
    ("max_n_sequences", 0), ("max_n_sequences", 1.5), ("max_n_sequences", True), ("max_n_sequences", 2**63),
    ("grammar_cache_memory_bytes", 0), ("grammar_cache_memory_bytes", None),
    ("max_grammar_memory_bytes", -1), ("max_grammar_memory_bytes", "1"),
    ("grammar_compile_timeout_s", 0), ("grammar_compile_timeout_s", -1.0), ("grammar_compile_timeout_s", float("nan")),
    ("grammar_compile_timeout_s", float("inf")), ("grammar_compile_timeout_s", True),
    ("grammar_compile_timeout_s", None),
    ("grammar_compile_workers", 0), ("grammar_compile_workers", 1.0),
])
def test_bad_limits_are_refused_with_their_name(tiny_model_dir, name, value):
    with pytest.raises(ValueError, match=name):
        EngineArgs(model=tiny_model_dir, **{name: value}).validate()


def test_limits_reach_the_config(tiny_model_dir):
    config = EngineArgs(model=tiny_model_dir, device="cpu", max_n_sequences=3, grammar_cache_memory_bytes=1000,
                        max_grammar_memory_bytes=100, grammar_compile_timeout_s=2,
                        grammar_compile_workers=5).create_config(light=True)
    assert config.scheduler_config.max_n_sequences == 3
    so = config.structured_outputs_config
    assert (so.cache_memory_bytes, so.max_grammar_memory_bytes, so.compile_timeout_s, so.compile_workers) == \
        (1000, 100, 2.0, 5)


def test_defaults(tiny_model_dir):
    config = EngineArgs(model=tiny_model_dir, device="cpu").create_config(light=True)
    so = config.structured_outputs_config
    assert config.scheduler_config.max_n_sequences == 128
    assert (so.cache_memory_bytes, so.max_grammar_memory_bytes, so.compile_timeout_s) == (256 * 2**20, 64 * 2**20,
                                                                                          10.0)
    # At least two compiles run at once, so that one slow compile never holds up the others.
    assert so.compile_workers == default_grammar_compile_workers() >= 2
