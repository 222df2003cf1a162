"""vx/config.py: the model facts read from a Hugging Face config, and model-directory JSON files."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vx.config import ModelConfig, hf_head_dim, hf_num_kv_heads, read_json


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
