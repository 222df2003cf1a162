"""A checkpoint's weight files, and the model config checked against what their headers hold before anything is
built: every layer the config names has tensors in the files, the token embedding has the config's shape, and the
files are large enough for the weights the config implies.

A config can claim a model its files do not hold (10**9 layers of a 30-layer checkpoint, MLPs a million wide); the
model would be allocated as claimed before the first tensor failed to fit. Only the files' headers are read
(safetensors' JSON header, a GGUF file's header within `vx.models.gguf.header`'s limits), so the checks cost milliseconds;
torch-free, so the front end runs them before an engine starts.
"""

from __future__ import annotations

import glob
import json
import os
import re
import struct
from typing import TYPE_CHECKING, Any, Mapping

from vx.config.model_limits import check_model_config, min_weight_count

if TYPE_CHECKING:
    from vx.models.gguf.header import GGUFHeader

_INDEX_FILE = "model.safetensors.index.json"
_SAFETENSORS_HEADER_LIMIT = 100 * 2**20  # safetensors' own limit on its JSON header
_SAFETENSORS_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_SAFETENSORS_EMBEDDING = "model.embed_tokens.weight"  # [vocab, hidden] in every family vx runs
_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.")
_GGUF_EMBEDDING = "token_embd.weight"  # [hidden, vocab] in GGML's order
# The fewest bits a weight is stored in: by any quantized format vx reads (GGUF's smallest types take 1.56 to
# 1.69), and in a float checkpoint (float8).
MIN_BITS_PER_WEIGHT = 1
MIN_BITS_PER_FLOAT_WEIGHT = 8

# What a GGUF header's keys (under "{arch}.") say, as the Hugging Face config fields transformers reads them into.
GGUF_CONFIG_KEYS: Mapping[str, str] = {
    "block_count": "num_hidden_layers", "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
    "context_length": "max_position_embeddings", "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.layer_norm_epsilon": "layer_norm_eps", "rope.freq_base": "rope_theta", "vocab_size": "vocab_size",
    "expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size", "attention.kv_lora_rank": "kv_lora_rank",
    "attention.q_lora_rank": "q_lora_rank", "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
}


def safetensors_files(model_path: str) -> list[str]:
    """The checkpoint files: those named in the shard index if present, else every *.safetensors."""
    if not os.path.isdir(model_path):
        raise ValueError(f"Model path {model_path!r} is not a directory.")
    index = os.path.join(model_path, _INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"Cannot read the shard index {index!r}: {e}") from e
        files = [os.path.join(model_path, name) for name in sorted(set(weight_map.values()))]
        missing = [p for p in files if not os.path.isfile(p)]
        if missing:
            raise ValueError(f"Shard index {index!r} names missing file(s): "
                             f"{', '.join(os.path.basename(p) for p in missing)}.")
        return files
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ValueError(f"No *.safetensors weights found in {model_path!r}.")
    return files


def safetensors_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in one safetensors file, from its JSON header alone; `ValueError` for a file that has
    none."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(_SAFETENSORS_HEADER_LIMIT, os.path.getsize(path) - 8):
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(f.read(length))
        return {name: tuple(int(d) for d in info["shape"]) for name, info in header.items() if name != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
        raise ValueError(f"Cannot read weights file {path!r} (missing or corrupted?): {e}") from e


def check_checkpoint(model_path: str, config: Any) -> None:
    """`config` (a config.json dict, a transformers config or an `HFConfig`, range-checked:
    vx.config.model_limits) against the safetensors files of `model_path`. A GGUF file's config directory is not
    checked here: its file was, when the directory was written (vx.config.model_source)."""
    fields = config if isinstance(config, Mapping) else config.to_dict()
    quantization = fields.get("quantization_config")
    if isinstance(quantization, Mapping) and quantization.get("quant_method") == "gguf":
        return
    shapes: dict[str, tuple[int, ...]] = {}
    files = safetensors_files(model_path)
    for path in files:
        shapes.update(safetensors_shapes(path))
    embedding = shapes.get(_SAFETENSORS_EMBEDDING)
    check_weights(fields, shapes, _SAFETENSORS_LAYER, embedding, sum(os.path.getsize(p) for p in files),
                  f"{model_path}/config.json",
                  min_bits=MIN_BITS_PER_WEIGHT if quantization else MIN_BITS_PER_FLOAT_WEIGHT)


def gguf_config_fields(header: GGUFHeader) -> tuple[dict[str, Any], dict[str, str]]:
    """The Hugging Face config fields a GGUF header states (read with its keys under "{arch}."), and each
    field's GGUF key (for messages). The vocabulary's size is its token list's length where no key states it."""
    arch = header.architecture
    fields: dict[str, Any] = {}
    names: dict[str, str] = {}
    for key, field in GGUF_CONFIG_KEYS.items():
        value = header.metadata.get(f"{arch}.{key}")
        if value is not None:
            fields[field], names[field] = value, f"{arch}.{key}"
    if "vocab_size" not in fields and "tokenizer.ggml.tokens" in header.array_lengths:
        fields["vocab_size"] = header.array_lengths["tokenizer.ggml.tokens"]
        names["vocab_size"] = "the length of tokenizer.ggml.tokens"
    # A MLA file's key length is the latent's or the expanded heads', no head width; per-layer counts are arrays.
    if f"{arch}.attention.key_length" in header.metadata and "kv_lora_rank" not in fields:
        fields["head_dim"], names["head_dim"] = header.metadata[f"{arch}.attention.key_length"], \
            f"{arch}.attention.key_length"
    return fields, names


def checked_gguf_header(path: str) -> tuple[GGUFHeader, dict[str, Any], dict[str, str]]:
    """A GGUF file's header, read within `vx.models.gguf.header`'s limits with every scalar and string value kept, and
    the config fields its keys state (with their keys), checked against vx.config.model_limits' ranges: what makes it
    safe for the gguf package and transformers to parse. `ValueError` naming the key."""
    from vx.models.gguf.header import read_gguf_header  # the gguf package (numpy): only where a GGUF file is read

    header = read_gguf_header(path, "")
    fields, names = gguf_config_fields(header)
    check_model_config(fields, f"GGUF file {path!r}", names)
    return header, fields, names


def check_gguf_file(path: str) -> GGUFHeader:
    """`checked_gguf_header`, and the shape the keys state checked against the file's tensors (`check_weights`);
    the header."""
    header, fields, names = checked_gguf_header(path)
    embedding = next((t.dims[::-1] for t in header.tensors if t.name == _GGUF_EMBEDDING), None)
    check_weights(fields, {t.name: t.dims for t in header.tensors}, _GGUF_LAYER, embedding,
                  os.path.getsize(path), f"GGUF file {path!r}", names)
    return header


def check_weights(fields: Mapping[str, Any], tensors: Mapping[str, tuple[int, ...]], layer_pattern: re.Pattern,
                  embedding: tuple[int, ...] | None, file_bytes: int, source: str,
                  names: Mapping[str, str] | None = None, min_bits: int = MIN_BITS_PER_WEIGHT) -> None:
    """`fields` (range-checked) against the tensors present: a tensor for every layer index below
    num_hidden_layers (`layer_pattern` finds it in a name), the embedding ([vocab, hidden], where present) as wide
    and as long as the config says, and `file_bytes` enough for `min_weight_count` at `min_bits` a weight."""
    names = names or {}
    layers = fields.get("num_hidden_layers")
    if layers:
        present = {int(m.group(1)) for name in tensors if (m := layer_pattern.search(name))}
        missing = [i for i in range(layers) if i not in present]
        if missing:
            raise ValueError(f"{source}: {names.get('num_hidden_layers', 'num_hidden_layers')}={layers}, but the "
                             f"weights hold tensors of {len(present)} layers (none of layer {missing[0]}).")
    if embedding is not None and len(embedding) == 2:
        for field, size in (("vocab_size", embedding[0]), ("hidden_size", embedding[1])):
            if fields.get(field) is not None and fields[field] != size:
                raise ValueError(f"{source}: {names.get(field, field)}={fields[field]}, but the token embedding "
                                 f"holds {size} ({'rows' if field == 'vocab_size' else 'columns'}).")
    implied = min_weight_count(fields)
    if implied * min_bits > 8 * file_bytes:
        raise ValueError(f"{source}: the config implies at least {implied:,} weights, which {file_bytes:,} bytes of "
                         f"weight files cannot hold (at {min_bits} bit{'s' if min_bits > 1 else ''} a weight, the "
                         "least their format takes).")
