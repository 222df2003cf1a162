"""A model's Hugging Face config: read from its directory (through transformers, or as plain JSON for a front end
that must not import torch), the facts vx takes from it (heads, lengths, eos ids, quantization), and the plain-field
form the engine process runs the model from.

The engine needs every field transformers fills in (a config.json may leave `head_dim`, `rms_norm_eps` or
`sliding_window` to the model type's defaults), but importing transformers' config classes costs the engine process
much memory (they pull in `torch.distributed.tensor` and sympy; measured: docs/architecture.md). So a config is
resolved through transformers once, in a throwaway way: where the front end already has the transformers config, it
sends its `to_dict()`; otherwise the engine resolves config.json once and keeps the result in
`$VX_CACHE_DIR/hf-config/`, keyed by the fields and the transformers version, and later engines read that file
instead of importing transformers.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import tempfile
from typing import Any

import msgspec

from vx import envs
from vx.config.model_limits import check_model_config
from vx.models.layers.quantization.registry import QUANTIZATION_NAMES


class HFConfig(dict):
    """A Hugging Face config's fields with attribute access (`config.hidden_size`), like a transformers config."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict[str, Any]:
        return dict(self)


class ResolvedHFConfig(HFConfig):
    """An `HFConfig` of every field transformers resolves (`resolve_hf_config`, or a resolved config as it crossed
    to the engine): it crosses on (to worker processes) as it is, never resolved again."""


def hf_num_kv_heads(hf_config: Any) -> int:
    """Key/value heads of a Hugging Face config: num_key_value_heads, else num_attention_heads (no GQA)."""
    return int(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)


def hf_is_mla(hf_config: Any) -> bool:
    """Whether a Hugging Face config describes Multi-head Latent Attention (it sets `kv_lora_rank`)."""
    return getattr(hf_config, "kv_lora_rank", None) is not None


def hf_kv_cache_dims(hf_config: Any) -> tuple[int, int]:
    """(heads, row width) of one token's KV-cache entry per layer.

    Most models cache num_kv_heads keys and values of head_dim each; MLA caches one latent row per token, the
    compressed kv (kv_lora_rank) followed by the shared rotary key part (qk_rope_head_dim), and no separate value.
    """
    if hf_is_mla(hf_config):
        return 1, int(hf_config.kv_lora_rank) + int(hf_config.qk_rope_head_dim)
    return hf_num_kv_heads(hf_config), hf_head_dim(hf_config)


def hf_head_dim(hf_config: Any) -> int:
    """Width of one attention head: the config's head_dim where it sets one (Qwen3), else hidden / heads."""
    hd = getattr(hf_config, "head_dim", None)
    return int(hd) if hd else int(hf_config.hidden_size // hf_config.num_attention_heads)


def config_fields(config: Any) -> dict[str, Any]:
    """A transformers config's fields (`to_dict()`) with its attribute aliases as fields too (`attribute_map`:
    Qwen3-MoE's `num_experts` is stored as `num_local_experts`), so that a plain `HFConfig` of them answers every name
    the transformers config does."""
    fields = dict(config.to_dict())
    for alias, name in (getattr(type(config), "attribute_map", None) or {}).items():
        if alias not in fields and name in fields:
            fields[alias] = fields[name]
    return fields


def hf_config_from_dict(data: dict[str, Any], model_path: str) -> Any:
    """The transformers config of a config.json dict (or of a transformers config's `to_dict()`): what
    `AutoConfig.from_pretrained` builds from the file. Imports transformers."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = data.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"Could not read the model config in {model_path!r}: unknown model_type {model_type!r}.")
    try:
        return CONFIG_MAPPING[model_type].from_dict(data)
    except Exception as e:  # transformers raises many kinds here
        raise ValueError(f"Could not read the model config in {model_path!r}: {e}") from e


def resolved_config_path(fields: dict[str, Any]) -> str:
    """Where the resolution of these config.json fields by the installed transformers is kept."""
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        version = "none"
    # "aliases" tags the cache's form (fields with their attribute aliases, config_fields): a file of another form
    # is never read back.
    key = hashlib.sha256(msgspec.json.encode(fields, order="sorted") + version.encode() + b"aliases").hexdigest()[:32]
    return os.path.join(envs.VX_CACHE_DIR.get(), "hf-config", f"{key}.json")


def resolve_hf_config(fields: dict[str, Any], model_path: str) -> ResolvedHFConfig:
    """config.json's `fields` with every default transformers fills in for the model type: from the cache when the
    same fields were resolved before with this transformers, else through transformers (then cached). The fields
    are range-checked first (vx.config.model_limits): transformers builds per-layer lists from them."""
    check_model_config(fields, f"the model config of {model_path!r}")
    path = resolved_config_path(fields)
    try:
        with open(path, "rb") as f:
            return ResolvedHFConfig(msgspec.json.decode(f.read()))
    except (OSError, msgspec.DecodeError):
        pass
    resolved = config_fields(hf_config_from_dict(fields, model_path))
    try:
        data = msgspec.json.encode(resolved)
    except (TypeError, ValueError, msgspec.EncodeError):  # a value JSON cannot hold: run from it, uncached
        return ResolvedHFConfig(resolved)
    try:  # the cache is an optimisation: a read-only or full disk only costs the next engine the import
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        pass
    # As a later engine reads it back from the cache (JSON makes the label maps' int keys strings), so that the
    # first engine and every later one run from the same fields.
    return ResolvedHFConfig(msgspec.json.decode(data))


def load_hf_config(path: str) -> Any:
    """The transformers config of the model directory `path`, range-checked (vx.config.model_limits) both as the
    file says and with its model type's defaults. Imports transformers (and torch)."""
    from transformers import AutoConfig

    # As the file says first: transformers' config classes build per-layer lists from the layer count, and so on.
    check_model_config(read_json(os.path.join(path, "config.json")), f"{path}/config.json")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers raises many kinds here
        raise ValueError(f"Could not read the model config in {path!r}: {e}") from e
    check_model_config(config, f"{path}/config.json (with its model type's defaults)")
    return config


def read_hf_config_json(path: str) -> HFConfig:
    """config.json of the model directory `path` as plain fields, range-checked: for a front end that never imports
    transformers."""
    raw = read_json(os.path.join(path, "config.json"))
    if not raw:
        raise ValueError(f"Could not read the model config in {path!r}: config.json is missing or not JSON.")
    if not isinstance(raw.get("vocab_size"), int):
        raise ValueError(f"{path}/config.json has no integer 'vocab_size'.")
    check_model_config(raw, f"{path}/config.json")
    return HFConfig(raw)


def derive_max_model_len(hf_config: Any) -> int | None:
    """The longest sequence the config says the model takes (None when it says nothing)."""
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        v = getattr(hf_config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def eos_token_ids(path: str, hf_config: Any) -> list[int]:
    """Every end-of-sequence token id the config and the directory's generation_config.json name, in order, once."""
    ids: list[int] = []
    for source in (hf_config.to_dict(), read_json(os.path.join(path, "generation_config.json"))):
        eos = source.get("eos_token_id")
        if isinstance(eos, int):
            eos = [eos]
        for e in eos or []:
            if isinstance(e, int) and e not in ids:
                ids.append(e)
    return ids


def checkpoint_quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's `quantization_config` as a dict (None when it has none)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    return dict(qc) if isinstance(qc, dict) else dict(qc.to_dict())


def resolve_quantization(requested: str | None, hf_config: Any) -> str | None:
    """The quantization method the model runs with: the checkpoint's own (its `quantization_config.quant_method`),
    else `requested` (quantize float weights at load), else None. A method vx cannot load is a `ValueError` naming
    it: loading its tensors as float weights would give a silently wrong model."""
    checkpoint = checkpoint_quantization_config(hf_config)
    if checkpoint is None:
        return requested
    method = str(checkpoint.get("quant_method", "")).lower()
    if method not in QUANTIZATION_NAMES:
        raise ValueError(f"The checkpoint is quantized with quant_method={method!r}, which vx cannot load; vx loads "
                         f"{', '.join(QUANTIZATION_NAMES) or 'no quantized checkpoints yet'}.")
    if requested is not None and requested != method:
        raise ValueError(f"quantization={requested!r} was asked for, but the checkpoint is quantized with "
                         f"{method!r}; leave quantization unset to load it as it is.")
    return method


def read_json(path: str) -> dict[str, Any]:
    """A JSON object file of a model directory; {} when it is missing, unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError):  # RecursionError: arrays or objects nested thousands deep
        return {}
    return data if isinstance(data, dict) else {}
