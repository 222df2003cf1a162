"""DefaultModelLoader: sharded and tied checkpoints load; every bad input fails with a clear ValueError."""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vx.models import DefaultModelLoader, resolve_model_class, supported_architectures

LOAD = DefaultModelLoader().load_model


def _copy(tiny, tmp_path) -> str:
    dst = str(tmp_path / "model")
    shutil.copytree(tiny.path, dst)
    return dst


def test_loaded_weights_equal_hf_and_model_is_ready(tiny_model):
    tiny = tiny_model("qwen2")
    model = LOAD(tiny.path, tiny.config, torch.float32, "cpu")
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    hf = tiny.hf_model.state_dict()
    attn = model.model.layers[1].self_attn
    fused = torch.cat([hf[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(attn.qkv_proj.weight, fused)
    assert torch.equal(attn.qkv_proj.bias, torch.cat([hf[f"model.layers.1.self_attn.{n}_proj.bias"] for n in "qkv"]))
    up = torch.cat([hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]])
    assert torch.equal(model.model.layers[0].mlp.gate_up_proj.weight, up)
    assert attn.o_proj.bias is None  # Qwen2: no o_proj bias


def test_tied_embeddings_share_one_tensor(tiny_model):
    tiny = tiny_model("llama3_tied")
    assert "lm_head.weight" not in load_file(os.path.join(tiny.path, "model.safetensors"))
    model = LOAD(tiny.path, tiny.config, torch.float32, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_sharded_checkpoint_via_index(tiny_model, tmp_path):
    tiny = tiny_model("llama")
    dst = str(tmp_path / "sharded")
    tiny.hf_model.save_pretrained(dst, max_shard_size="100KB")
    assert os.path.isfile(os.path.join(dst, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(dst) if f.endswith(".safetensors")]) > 1
    model = LOAD(dst, tiny.config, torch.float32, "cpu")
    assert torch.equal(model.model.norm.weight, tiny.hf_model.model.norm.weight)


def test_missing_dir_or_weights(tiny_model, tmp_path):
    tiny = tiny_model("llama")
    with pytest.raises(ValueError, match="not a directory"):
        LOAD(str(tmp_path / "nope"), tiny.config, torch.float32, "cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="No \\*.safetensors"):
        LOAD(str(tmp_path / "empty"), tiny.config, torch.float32, "cpu")


def test_unknown_architecture_lists_supported(tiny_model):
    with pytest.raises(ValueError) as e:
        resolve_model_class("GPT2LMHeadModel")
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in str(e.value) and arch in supported_architectures()
    tiny = tiny_model("llama")
    config = type(tiny.config).from_dict({**tiny.config.to_dict(), "architectures": ["FooForCausalLM"]})
    with pytest.raises(ValueError, match="FooForCausalLM.*LlamaForCausalLM"):
        LOAD(tiny.path, config, torch.float32, "cpu")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupted_safetensors(tiny_model, tmp_path, damage):
    tiny = tiny_model("llama")
    dst = _copy(tiny, tmp_path)
    path = os.path.join(dst, "model.safetensors")
    if damage == "truncate":
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.truncate(size // 2)
    else:
        with open(path, "wb") as f:
            f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header at all")
    with pytest.raises(ValueError, match="model.safetensors"):
        LOAD(dst, tiny.config, torch.float32, "cpu")


def test_index_naming_a_missing_shard(tiny_model, tmp_path):
    tiny = tiny_model("llama")
    dst = _copy(tiny, tmp_path)
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}, f)
    with pytest.raises(ValueError, match="model-00002-of-00002"):
        LOAD(dst, tiny.config, torch.float32, "cpu")


def test_unloaded_parameters_are_named(tiny_model, tmp_path):
    tiny = tiny_model("qwen3")
    dst = _copy(tiny, tmp_path)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.norm.weight"]
    del tensors["model.layers.1.self_attn.k_proj.weight"]  # leaves the fused qkv only partly loaded
    del tensors["model.layers.0.self_attn.q_norm.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        LOAD(dst, tiny.config, torch.float32, "cpu")
    msg = str(e.value)
    for name in ("model.norm.weight", "model.layers.1.self_attn.qkv_proj.weight",
                 "model.layers.0.self_attn.q_norm.weight"):
        assert name in msg


def test_wrong_shape_is_refused(tiny_model, tmp_path):
    tiny = tiny_model("llama")
    dst = _copy(tiny, tmp_path)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:-1].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="does not match"):
        LOAD(dst, tiny.config, torch.float32, "cpu")


@pytest.mark.parametrize("field, value, message", [
    ("num_hidden_layers", 10**9, "num_hidden_layers=1000000000 is out of range"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps=nan is not a finite number"),
    ("num_attention_heads", 0, "num_attention_heads=0 is out of range"),
])
def test_a_config_out_of_range_is_refused_before_the_model_is_built(tiny_model, field, value, message):
    """A config that did not come through EngineArgs (which checks it first) is checked by the loader too."""
    tiny = tiny_model("llama")
    config = copy.deepcopy(tiny.config)
    setattr(config, field, value)  # as transformers' own checks would not let it be built
    with pytest.raises(ValueError, match=f"the model config of '{tiny.path}': {message}"):
        LOAD(tiny.path, config, torch.float32, "cpu")
