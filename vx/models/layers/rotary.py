"""Rotary position embedding (rotate-half / neox style, as Hugging Face Llama applies it).

cos and sin are computed per forward for the batch's positions in float32, exactly as Hugging Face computes them
(positions * inv_freq, then cos/sin, times the scaling's attention factor), so results match bit for bit before
the cast.

Scalings: linear, llama3, yarn and longrope (Phi-3's "su"). LongRoPE has two sets of frequencies: the short one
up to `original_max_position_embeddings`, the long one past it. vx picks the set by position (a position past the
original length uses the long set), so a token's rotation never depends on what else shares the batch and
cached keys stay valid. Hugging Face picks one set per sequence from its length, and Phi-3's `generate` re-encodes
the whole sequence with the long set when it grows past the original length: the two agree on sequences within
the original length and differ past it (vLLM's choice, one set per batch, differs from both). Dynamic NTK
rescales by the current length and is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass
class RopeConfig:
    """The rope settings of a model, whichever way its config stores them."""

    theta: float = 10000.0
    rope_type: str = "default"
    partial_rotary_factor: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)  # factor, low_freq_factor, ...


def get_rope_config(hf_config: Any, layer_type: str | None = None) -> RopeConfig:
    """Read rope settings from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling` (older); with
    `layer_type`, the settings of that kind of layer where the config has one per kind (Gemma 3)."""
    params: dict[str, Any] = {}
    rp = getattr(hf_config, "rope_parameters", None)
    if isinstance(rp, dict) and layer_type is not None and isinstance(rp.get(layer_type), dict):
        rp = rp[layer_type]
    if isinstance(rp, dict):
        params.update(rp)
    scaling = getattr(hf_config, "rope_scaling", None)
    if isinstance(scaling, dict):
        for k, v in scaling.items():
            params.setdefault(k, v)
    theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", None) \
        or getattr(hf_config, "default_theta", None) or 10000.0
    rope_type = params.get("rope_type") or params.get("type") or "default"
    partial = params.get("partial_rotary_factor") or getattr(hf_config, "partial_rotary_factor", None) or 1.0
    if rope_type in ("llama3", "yarn", "longrope"):
        # Same fallback Hugging Face uses when the checkpoint omits it.
        params.setdefault("original_max_position_embeddings",
                          getattr(hf_config, "original_max_position_embeddings", None)
                          or hf_config.max_position_embeddings)
    return RopeConfig(theta=float(theta), rope_type=str(rope_type), partial_rotary_factor=float(partial),
                      params=params)


def check_rope_type(rope: RopeConfig) -> None:
    """Refuse, by name, a scaling vx does not implement."""
    if rope.rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope.rope_type!r} is not supported; "
                         f"supported: {', '.join(_SUPPORTED_ROPE_TYPES)}.")


def compute_inv_freq(rotary_dim: int, rope: RopeConfig, long: bool = False) -> torch.Tensor:
    """Inverse frequencies [rotary_dim/2] in float32 for the rope type; `long`: LongRoPE's set past the original
    length."""
    check_rope_type(rope)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    if rope.rope_type == "longrope":
        factors = rope.params["long_factor" if long else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * rope.theta ** exponents)
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.params["factor"]
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope.params)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, rope)
    return inv_freq


def attention_factor(rope: RopeConfig, max_position_embeddings: int) -> float:
    """What cos and sin are multiplied by (yarn's mscale, longrope's sqrt(1 + ln s / ln L)); 1 for the others."""
    p = rope.params
    if rope.rope_type not in ("yarn", "longrope"):
        return 1.0
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position_embeddings / original
    if rope.rope_type == "longrope":
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    if p.get("mscale") and p.get("mscale_all_dim"):
        return float(_yarn_mscale(factor, p["mscale"]) / _yarn_mscale(factor, p["mscale_all_dim"]))
    return _yarn_mscale(factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, rope: RopeConfig) -> torch.Tensor:
    """YaRN: interpolate (divide by `factor`) the low frequencies, keep the high ones, ramp linearly between the
    dimensions that turn `beta_slow` and `beta_fast` times over the original context."""
    p, base = rope.params, rope.theta
    original = p["original_max_position_embeddings"]
    factor = p["factor"]
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: keep high frequencies, divide low ones by `factor`, blend smoothly in between."""
    factor = p["factor"]
    low, high = p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Applies rotary embedding to q and k by token position.

    The model calls `cos_sin(positions, dtype)` once per forward and passes the pair to every layer's
    `apply`, so cos and sin are computed once rather than per layer.
    """

    def __init__(self, head_dim: int, rope: RopeConfig, max_position_embeddings: int) -> None:
        super().__init__()
        check_rope_type(rope)
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * rope.partial_rotary_factor)
        self.scale = attention_factor(rope, max_position_embeddings)
        # Computed on the CPU for the same numbers on every device, then moved to the default (target) device.
        device = torch.get_default_device()
        self.register_buffer("inv_freq", compute_inv_freq(self.rotary_dim, rope).to(device), persistent=False)
        self.original_max_position: int | None = None
        if rope.rope_type == "longrope":
            self.original_max_position = int(rope.params["original_max_position_embeddings"])
            self.register_buffer("long_inv_freq", compute_inv_freq(self.rotary_dim, rope, long=True).to(device),
                                 persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rotary_dim] for the given positions, in `dtype`, broadcastable over heads.

        Computed for these positions only, not looked up in a table of every position: such a table costs
        2 x max_position_embeddings x rotary_dim floats (128 MiB for a 128k-context model with 128-dim heads),
        resident for the engine's life, where this costs a few small ops per forward."""
        t = positions.to(torch.float32)[:, None]
        freqs = t * self.inv_freq
        if self.original_max_position is not None:
            freqs = torch.where(positions[:, None] >= self.original_max_position, t * self.long_inv_freq, freqs)
        cos, sin = freqs.cos(), freqs.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        # Laid out so that x*cos + swap_halves(x)*sin is the rotation: sin carries the sign of rotate_half. Float32
        # up to here even for half models, as Hugging Face computes them, then cast.
        cos = torch.cat((cos, cos), dim=-1).to(dtype).unsqueeze(1)
        sin = torch.cat((-sin, sin), dim=-1).to(dtype).unsqueeze(1)
        return cos, sin

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] (its first rotary_dim dims) by the given cos/sin."""
        rd = self.rotary_dim
        if rd == self.head_dim:
            return x * cos + _swap_halves(x) * sin
        rot, rest = x[..., :rd], x[..., rd:]
        return torch.cat((rot * cos + _swap_halves(rot) * sin, rest), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq*D] and k [T, Hk*D] for `positions` [T]; returns the same shapes."""
        cos, sin = self.cos_sin(positions, q.dtype)
        t = q.shape[0]
        q = self.apply(q.view(t, -1, self.head_dim), cos, sin).reshape(t, -1)
        k = self.apply(k.view(t, -1, self.head_dim), cos, sin).reshape(t, -1)
        return q, k

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, scale={self.scale}"


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


def get_rope(hf_config: Any, head_dim: int, layer_type: str | None = None) -> RotaryEmbedding:
    """Build the rotary embedding a Hugging Face config describes (for `layer_type`'s layers, see get_rope_config)."""
    return RotaryEmbedding(head_dim, get_rope_config(hf_config, layer_type), int(hf_config.max_position_embeddings))
