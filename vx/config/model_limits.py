"""The ranges a model config's shape fields must lie in, checked before anything is built from them.

A config.json (or a GGUF header) can claim anything: 10**9 layers make transformers' config classes build
per-layer lists for minutes and gigabytes, a NaN epsilon runs and answers token 0 silently, zero heads or a negative
width fail deep inside torch. Each field is checked here against a range every real model lies well inside (and
every tiny test model), so such a file fails at once with a `ValueError` naming the field and its value. torch- and
transformers-free: the front end checks config.json as plain JSON, before transformers reads it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

# field -> (least, most) for the integer fields; a field that is absent or None is not checked (its default is).
INT_RANGES: Mapping[str, tuple[int, int]] = {
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 4096),
    "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 20),
    "moe_intermediate_size": (1, 1 << 20),
    "vocab_size": (1, 1 << 21),
    "max_position_embeddings": (1, 1 << 27),
    "sliding_window": (0, 1 << 27),
    "num_local_experts": (0, 4096),
    "num_experts": (0, 4096),
    "n_routed_experts": (0, 4096),
    "n_shared_experts": (0, 4096),
    "num_experts_per_tok": (0, 4096),
    "kv_lora_rank": (1, 1 << 16),
    "q_lora_rank": (1, 1 << 16),
    "qk_rope_head_dim": (1, 4096),
    "qk_nope_head_dim": (0, 4096),
    "v_head_dim": (1, 4096),
    "original_max_position_embeddings": (1, 1 << 27),
}

# Fields that must be finite and positive, with their largest value (norm epsilons above 1 are no epsilon).
POSITIVE_FLOATS: Mapping[str, float] = {
    "rms_norm_eps": 1.0, "layer_norm_eps": 1.0, "layer_norm_epsilon": 1.0, "norm_eps": 1.0,
    "rope_theta": math.inf, "attn_logit_softcapping": math.inf, "final_logit_softcapping": math.inf,
    "query_pre_attn_scalar": math.inf, "routed_scaling_factor": math.inf, "partial_rotary_factor": 1.0,
}

# The same checks inside a rope dict (`rope_parameters`, `rope_scaling`, or one per layer kind within them).
_ROPE_POSITIVE = {"rope_theta": math.inf, "factor": math.inf, "partial_rotary_factor": 1.0}
_ROPE_DICTS = ("rope_parameters", "rope_scaling")

_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")


def check_model_config(config: Any, source: str, names: Mapping[str, str] | None = None) -> None:
    """`ValueError` naming the field and its value if a shape field of `config` (a config.json dict, a transformers
    config or an `HFConfig`) lies outside its range, a float is not finite or positive where it must be, or the
    heads do not divide what they must. `source` says where the config came from; `names` maps a field to the name
    the file gave it (a GGUF key), for the message."""
    fields = _fields(config)

    def fail(field: str, problem: str) -> ValueError:
        return ValueError(f"{source}: {(names or {}).get(field, field)}={fields.get(field)!r} {problem}.")

    bad = _non_finite(fields)
    if bad is not None:
        raise ValueError(f"{source}: {(names or {}).get(bad[0], bad[0])}={bad[1]!r} is not a finite number.")
    for field, (least, most) in INT_RANGES.items():
        value = fields.get(field)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise fail(field, "is not an integer")
        if not least <= value <= most:
            raise fail(field, f"is out of range (vx accepts {least} to {most})")
    for field, most in POSITIVE_FLOATS.items():
        if (problem := _not_positive(fields.get(field), most)) is not None:
            raise fail(field, problem)
    for key in _ROPE_DICTS:
        rope = fields.get(key)
        if isinstance(rope, Mapping):
            for part in (rope, *(v for v in rope.values() if isinstance(v, Mapping))):
                for field, most in _ROPE_POSITIVE.items():
                    if (problem := _not_positive(part.get(field), most)) is not None:
                        raise ValueError(f"{source}: {key}'s {field}={part.get(field)!r} {problem}.")
    _check_heads(fields, fail)
    experts = next((fields[k] for k in _EXPERT_COUNTS if fields.get(k)), None)
    used = fields.get("num_experts_per_tok")
    if experts and used is not None and used > experts:
        raise fail("num_experts_per_tok", f"is more than the {experts} experts")


def _fields(config: Any) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    to_dict = getattr(config, "to_dict", None)
    return to_dict() if callable(to_dict) else vars(config)


def _not_positive(value: Any, most: float) -> str | None:
    """What is wrong with a value that must be a positive number up to `most` (None: nothing, or absent)."""
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "is not a number"
    if not 0 < value <= most:
        return "must be positive" + ("" if most == math.inf else f" and at most {most}")
    return None


def _check_heads(fields: Mapping[str, Any], fail: Any) -> None:
    """Query heads a multiple of KV heads (each KV head serves a group), and, where the head width is not given,
    hidden_size a multiple of the heads (it is hidden_size / heads then)."""
    heads, kv_heads = fields.get("num_attention_heads"), fields.get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        raise fail("num_key_value_heads", f"does not divide num_attention_heads={heads}")
    hidden = fields.get("hidden_size")
    if heads and hidden and not fields.get("head_dim") and fields.get("kv_lora_rank") is None and hidden % heads:
        raise fail("hidden_size", f"is not a multiple of num_attention_heads={heads} (no head_dim is given)")


def _non_finite(fields: Mapping[str, Any]) -> tuple[str, float] | None:
    """The first NaN or infinity anywhere in a config (JSON admits neither, Python's reader does), with its path.
    Walked with a stack of its own: a config may nest as deep as the JSON reader allowed."""
    stack: list[tuple[str, Any]] = [("", fields)]
    while stack:
        name, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return name, value
        if isinstance(value, Mapping):
            items: Any = value.items()
        elif isinstance(value, (list, tuple)):
            items = enumerate(value)
        else:
            continue
        stack.extend((f"{name}.{key}" if name else str(key), item) for key, item in reversed(list(items)))
    return None


def min_weight_count(config: Any) -> int:
    """A lower bound on the weights a model of this config holds: the token embedding, and per layer the attention
    projections and the smallest MLP its layers may have (dense, or all experts). What a config's files must hold
    at least (vx.config.checkpoint_files); fields that are absent count nothing."""
    f = _fields(config)
    hidden, layers = f.get("hidden_size") or 0, f.get("num_hidden_layers") or 0
    heads = f.get("num_attention_heads") or 0
    if f.get("kv_lora_rank") is not None:  # MLA: the output projection and the latent's up-projection at least
        v_dim = f.get("v_head_dim") or 0
        attention = heads * v_dim * hidden + f["kv_lora_rank"] * heads * ((f.get("qk_nope_head_dim") or 0) + v_dim)
    else:
        head_dim = f.get("head_dim") or (hidden // heads if heads else 0)
        attention = hidden * head_dim * (2 * heads + 2 * (f.get("num_key_value_heads") or heads))
    widths = [f["intermediate_size"]] if f.get("intermediate_size") else []
    experts = next((f[k] for k in _EXPERT_COUNTS if f.get(k)), 0)
    if experts:
        widths.append(experts * (f.get("moe_intermediate_size") or f.get("intermediate_size") or 0))
    mlp = 3 * hidden * min(widths) if widths else 0
    return (f.get("vocab_size") or 0) * hidden + layers * (attention + mlp)
