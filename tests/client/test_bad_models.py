"""A model that is missing, not a model, corrupted or of an unsupported architecture gets a clear error that
says what is wrong (and where), from `vx.LLM` and from `vx.AsyncLLM`; nothing is left running."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from tests.support.engine_processes import ENGINE_KWARGS, child_pids

import vx

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


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
async def test_unsupported_architecture_through_async_llm(anyio_backend, tiny_model_dir, tmp_path):
    """The engine process finds out at start-up; `async with` raises at once, with the loader's message."""
    path = broken_copy(tiny_model_dir, tmp_path, "gpt2")
    before = child_pids()
    llm = vx.AsyncLLM(path, **ENGINE_KWARGS)
    with pytest.raises(vx.EngineDeadError, match="failed to start: ValueError: .*GPT2LMHeadModel.*Supported: "
                                                 + ", ".join(SUPPORTED)):
        async with llm:
            pass
    assert child_pids() <= before
