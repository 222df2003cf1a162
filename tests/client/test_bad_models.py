"""A model that is missing, not a model, corrupted or of an unsupported architecture gets a clear error that
says what is wrong (and where), from `vx.LLM` and from `vx.AsyncLLM`; nothing is left running."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from tests.support.engine_processes import ENGINE_KWARGS, child_pids

import vx
from vx.model_architectures import MODEL_CLASSES

SUPPORTED = tuple(sorted(MODEL_CLASSES))


def broken_copy(tiny_model_dir: str, tmp_path, damage: str) -> str:
    """A copy of the tiny model with one thing broken."""
    dst = str(tmp_path / f"model-{damage}")
    shutil.copytree(tiny_model_dir, dst)
    if damage == "garbage-weights":
        with open(os.path.join(dst, "model.safetensors"), "wb") as f:
            f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header at all" + os.urandom(256))
    elif damage == "truncated-weights":
        path = os.path.join(dst, "model.safetensors")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    elif damage == "no-weights":
        os.remove(os.path.join(dst, "model.safetensors"))
    elif damage == "gpt2":
        path = os.path.join(dst, "config.json")
        with open(path) as f:
            config = json.load(f)
        config["architectures"] = ["GPT2LMHeadModel"]
        with open(path, "w") as f:
            json.dump(config, f)
    elif damage == "config-not-json":
        with open(os.path.join(dst, "config.json"), "w") as f:
            f.write("{ this is not json")
    else:
        raise ValueError(damage)
    return dst


@pytest.mark.parametrize("where, message", [
    ("missing", "does not exist"),
    ("file", "not a .gguf model"),
    ("folder", "not a model directory"),
])
def test_model_path_that_is_not_a_model(tiny_model_dir, tmp_path, where, message):
    path = {"missing": str(tmp_path / "no-such-model"),
            "file": os.path.join(tiny_model_dir, "config.json"),
            "folder": str(tmp_path)}[where]
    with pytest.raises(ValueError, match=message):
        vx.LLM(path, **ENGINE_KWARGS)
    with pytest.raises(ValueError, match=message):
        vx.AsyncLLM(path, **ENGINE_KWARGS)  # refused by the constructor, before any engine starts


def test_unknown_engine_argument_lists_the_known_ones(tiny_model_dir):
    for make in (vx.LLM, vx.AsyncLLM):
        with pytest.raises(ValueError, match="Unknown engine argument.*max_num_sequences.*Known:.*max_num_seqs"):
            make(tiny_model_dir, max_num_sequences=4)


@pytest.mark.parametrize("damage, message", [
    ("garbage-weights", r"Cannot read weights file .*model\.safetensors"),
    ("truncated-weights", r"model\.safetensors"),
    ("no-weights", r"No \*\.safetensors weights"),
    ("gpt2", "'GPT2LMHeadModel' is not supported. Supported: " + ", ".join(SUPPORTED)),
    ("config-not-json", "Could not read the model config"),
])
def test_broken_model_in_process(tiny_model_dir, tmp_path, damage, message):
    path = broken_copy(tiny_model_dir, tmp_path, damage)
    with pytest.raises(ValueError, match=message):
        vx.LLM(path, **ENGINE_KWARGS)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.anyio
async def test_unsupported_architecture_is_refused_before_an_engine_starts(anyio_backend, tiny_model_dir, tmp_path):
    """Starting reads config.json's architectures and refuses an unknown one with the supported list, before any
    engine process exists."""
    path = broken_copy(tiny_model_dir, tmp_path, "gpt2")
    before = child_pids()
    llm = vx.AsyncLLM(path, **ENGINE_KWARGS)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*Supported: " + ", ".join(SUPPORTED)):
        async with llm:
            pass
    assert child_pids() <= before


# ------------------------------------------------------------------------------------------ quantized checkpoints
def _awq_checkpoint(tiny_model_dir: str, tmp_path, **config) -> str:
    from tests.support.quantized_checkpoints import awq, quantized_pair

    quant_dir, _ = quantized_pair(tiny_model_dir, tmp_path, awq(32), {
        "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm", **config})
    return quant_dir


@pytest.mark.parametrize("multiprocess", [False, True])
def test_a_quantized_checkpoint_vx_cannot_read_is_refused_at_load(tiny_model_dir, tmp_path, multiprocess):
    """The front end knows the method (awq) but not its variant (3-bit): the engine refuses as it loads, and
    nothing of it is left."""
    path = _awq_checkpoint(tiny_model_dir, tmp_path, bits=3)
    before = child_pids()
    error = vx.EngineDeadError if multiprocess else ValueError
    with pytest.raises(error, match="AWQ with 3-bit weights is not supported"):
        vx.LLM(path, multiprocess=multiprocess, **ENGINE_KWARGS)
    assert child_pids() <= before


@pytest.mark.parametrize("checkpoint, configured, message", [
    ({"quant_method": "bitnet", "bits": 1}, None,
     "quantized with quant_method='bitnet', but the engine was configured to load it with quantization=None"),
    (None, "gptq", "quantized with quant_method='awq', but the engine was configured to load it with "
                   "quantization='gptq'"),
])
@pytest.mark.parametrize("multiprocess", [False, True])
def test_the_engine_refuses_a_config_made_elsewhere_that_disagrees_with_the_checkpoint(
        tiny_model_dir, tmp_path, checkpoint, configured, message, multiprocess):
    """EngineArgs resolves the method from the checkpoint; a VxConfig made otherwise can disagree with it, and the
    engine then refuses at load instead of reading quantized tensors some other way."""
    import msgspec

    from vx.client.llm_engine import LLMEngine
    from vx.config import EngineArgs, QuantConfig

    path = _awq_checkpoint(tiny_model_dir, tmp_path)
    config = EngineArgs(model=path, **ENGINE_KWARGS).create_config()
    if checkpoint is not None:
        config.model_config.hf_config.quantization_config = checkpoint
    config = msgspec.structs.replace(config, quant_config=QuantConfig(method=configured))
    before = child_pids()
    error = vx.EngineDeadError if multiprocess else ValueError
    with pytest.raises(error, match=message):
        LLMEngine(config, multiprocess=multiprocess)
    assert child_pids() <= before
