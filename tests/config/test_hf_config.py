"""vx/config/hf_config.py: the model facts read from a Hugging Face config and model-directory JSON files, the light
(plain JSON) config a front end reads against the one transformers resolves, the resolution cached for the engine
process, and the checkpoint's quantization."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import msgspec
import pytest

from tests.support.kernel_cache import share_kernels
from vx.config import EngineArgs, ModelConfig, decode_config, encode_config, hf_head_dim, hf_num_kv_heads, read_json
from vx.config.hf_config import config_fields, resolve_hf_config


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


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
def test_the_front_ends_light_config_is_what_the_engine_would_resolve(tiny_model_dirs, family):
    """`AsyncLLM` resolves the config from config.json as plain JSON (no transformers, no torch); the engine uses
    it as sent, so it must be the config that the full resolution (through transformers) gives."""
    args = EngineArgs(model=tiny_model_dirs[family], device="cpu", max_num_seqs=3)
    full = args.create_config()
    received = decode_config(encode_config(args.create_config(light=True)))
    # Every field but the config's own path and the (classification) label maps, whose int keys JSON makes strings.
    def fields(hf):
        return {k: v for k, v in config_fields(hf).items() if k not in ("_name_or_path", "id2label", "label2id")}

    assert fields(received.model_config.hf_config) == fields(full.model_config.hf_config)
    # Every name the transformers config answers, its aliases too (Qwen3-MoE's and Mixtral's num_experts is stored
    # as num_local_experts): the MoE models read them (an engine process or a worker failed on it).
    for alias in type(full.model_config.hf_config).attribute_map:
        assert getattr(received.model_config.hf_config, alias) == getattr(full.model_config.hf_config, alias)
    def without_hf(config):
        return msgspec.structs.replace(config, model_config=msgspec.structs.replace(config.model_config,
                                                                                    hf_config=None))

    assert without_hf(received) == without_hf(full)


def test_a_config_is_resolved_through_transformers_once_then_from_the_cache(tmp_path, monkeypatch):
    """The engine process fills in the model type's defaults (here Qwen3's head_dim 128, Mistral's sliding window
    4096, neither in config.json) as transformers does, and keeps the result: a second engine with the same fields
    reads the cache file and does not import transformers. Other fields or another model type miss the cache."""
    monkeypatch.setenv("VX_CACHE_DIR", str(tmp_path))
    share_kernels(tmp_path)
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    qwen3 = resolve_hf_config(dict(base, model_type="qwen3"), "m")
    mistral = resolve_hf_config(dict(base, model_type="mistral"), "m")
    assert (qwen3.head_dim, hf_head_dim(qwen3), qwen3.sliding_window) == (128, 128, None)
    assert (mistral.sliding_window, hf_head_dim(mistral), mistral.rms_norm_eps) == (4096, 16, 1e-6)
    assert len(list((tmp_path / "hf-config").iterdir())) == 2

    code = ("import sys, json; from vx.config.hf_config import resolve_hf_config; "
            f"c = resolve_hf_config(json.loads({json.dumps(json.dumps(dict(base, model_type='qwen3')))}), 'm'); "
            "print(c.head_dim, 'transformers' in sys.modules)")
    env = {**os.environ, "VX_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["128", "False"]
    with pytest.raises(ValueError, match="unknown model_type 'nonsense'"):
        resolve_hf_config(dict(base, model_type="nonsense"), "m")
    # A config sent to the engine without EngineArgs' checks: refused before transformers builds 10**9 layer types.
    with pytest.raises(ValueError, match="num_hidden_layers=1000000000 is out of range"):
        resolve_hf_config(dict(base, model_type="qwen3", num_hidden_layers=10**9), "m")


# ------------------------------------------------------------------------------------------ quantization
def _with_quantization_config(src: str, dst, quant_config: dict) -> str:
    import json
    import shutil

    shutil.copytree(src, dst)
    with open(dst / "config.json") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quant_config
    with open(dst / "config.json", "w") as f:
        json.dump(cfg, f)
    return str(dst)


@pytest.mark.parametrize("light", [True, False])
def test_a_checkpoint_quantized_in_an_unknown_way_is_refused_naming_it(tiny_model_dir, tmp_path, light):
    """Loading such tensors as float weights gives a silently wrong model (an FP8 checkpoint's weights ~480x too
    large): the config refuses it, in the front end (light) as in the engine, before anything loads."""
    model = _with_quantization_config(tiny_model_dir, tmp_path / "m", {"quant_method": "bitnet", "bits": 1})
    with pytest.raises(ValueError, match="quantized with quant_method='bitnet', which vx cannot load"):
        EngineArgs(model=model, device="cpu").create_config(light=light)
