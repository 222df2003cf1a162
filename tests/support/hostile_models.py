"""Hostile model files, small and quick to write: a tiny model's copy with config.json fields changed, a GGUF file
of millions of empty vocabulary strings (8 bytes each on disk, a Python object each once parsed), and a small GGUF
file whose keys state any shape over a few tensors."""

from __future__ import annotations

import json
import os
import shutil
import struct
from typing import Any

import numpy as np
from gguf import GGUF_MAGIC, GGUFValueType, GGUFWriter


def with_config(src_dir: str, dst: str | os.PathLike, **changes: Any) -> str:
    """A copy of the model directory `src_dir` in `dst` with these config.json fields changed (written as Python's
    json writes them: a NaN as `NaN`)."""
    dst = os.fspath(dst)
    shutil.copytree(src_dir, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)
    return dst


def _gguf_string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def write_string_bomb(path: str | os.PathLike, count: int = 5_000_000, key: str = "tokenizer.ggml.tokens") -> str:
    """A GGUF file (arch llama, no tensors) whose `key` holds `count` empty strings: 8 bytes each, written as one
    block of zeros."""
    path = os.fspath(path)
    with open(path, "wb") as f:
        f.write(struct.pack("<IIQQ", GGUF_MAGIC, 3, 0, 2))
        f.write(_gguf_string("general.architecture") + struct.pack("<I", GGUFValueType.STRING) + _gguf_string("llama"))
        f.write(_gguf_string(key) + struct.pack("<IIQ", GGUFValueType.ARRAY, GGUFValueType.STRING, count))
        f.write(bytes(8 * count))
    return path


def write_small_gguf(path: str | os.PathLike, layers_stated: int = 2, layers_stored: int = 2, hidden: int = 64,
                     vocab: int = 16, arch: str = "llama", **keys: Any) -> str:
    """A GGUF file (of `arch`, Llama's keys) of float32 tensors (a token embedding, a norm and an MLP's down projection per stored
    layer: as many bytes as the stated model at 1 bit a weight) whose keys state `layers_stated` layers of width
    `hidden`, 4 heads (2 KV), an MLP of 128, a `vocab`-token vocabulary; `keys` ("llama.context_length": 10**12,
    say) add or override keys, as the writer's Python values."""
    path = os.fspath(path)
    writer = GGUFWriter(path, arch)
    stated = {f"{arch}.{key}": value for key, value in (
        ("block_count", layers_stated), ("embedding_length", hidden), ("feed_forward_length", 128),
        ("attention.head_count", 4), ("attention.head_count_kv", 2), ("context_length", 256),
        ("attention.layer_norm_rms_epsilon", 1e-6), ("rope.freq_base", 10000.0))}
    stated.update({"tokenizer.ggml.model": "gpt2", **keys})
    for key, value in stated.items():
        writer.add_key_value(key, value, _value_type(value))
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_tensor("token_embd.weight", np.zeros((vocab, hidden), np.float32))
    for layer in range(layers_stored):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{layer}.ffn_down.weight", np.zeros((hidden, 128), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _value_type(value: Any) -> GGUFValueType:
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, str):
        return GGUFValueType.STRING
    return GGUFValueType.UINT64 if value >= 1 << 32 else GGUFValueType.UINT32


def truncate_weights(path: str) -> None:
    """Cut a safetensors file's data in half, its header intact: the front end's header checks pass, and only the
    engine, loading the tensors, finds the file broken."""
    with open(path, "rb") as f:
        (header_length,) = struct.unpack("<Q", f.read(8))
    data_start = 8 + header_length
    with open(path, "r+b") as f:
        f.truncate(data_start + (os.path.getsize(path) - data_start) // 2)
