"""Quantized Hugging Face checkpoints built from a tiny float model's known weights, packed as AWQ, GPTQ and FP8
checkpoints are on disk, each beside its float twin (the same model with the dequantized weights), so that a test
compares vx on the two.

The packing follows the formats' documented layouts and is written here independently of vx's unpacking, so that a
wrong reading in vx cannot cancel out:
- AWQ (AutoAWQ's WQLinear_GEMM): qweight int32 [K, N / 8], qzeros int32 [K / G, N / 8], scales fp16 [K / G, N];
  codes packed along the output features, slot i (bits 4i..4i+3) of a word holding feature ORDER[i] of its eight,
  ORDER = 0, 2, 4, 6, 1, 3, 5, 7 (AutoAWQ's `order_map`); w = (q - z) * s.
- GPTQ (AutoGPTQ's QuantLinear): qweight int32 [K / P, N] packed along the input (slot i of word j: input
  j * P + i), qzeros int32 [K / G, N / P] packed along the output the same way, scales fp16 [K / G, N], g_idx int32
  [K]; format "gptq" (v1) stores each zero minus 1, "gptq_v2" the zero; w = (q - z[g_idx]) * s[g_idx].
- FP8 (vLLM / llm-compressor): weight float8_e4m3fn [N, K], weight_scale float32 (one number per tensor, or [N, 1]
  per channel), input_scale per tensor with a static activation scheme; w = weight * weight_scale.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from tests.support.tiny_models import make_tiny_model
from tests.support.tiny_tokenizer import make_tiny_tokenizer

# Every linear layer of a tiny model has 128 or 256 input features, so groups of 32, 64 and 128 all fit.
QUANT_MODEL_OVERRIDES: dict[str, Any] = dict(hidden_size=128, intermediate_size=256, eos_token_id=0,
                                             bos_token_id=0, pad_token_id=0)
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FP8_MAX = 448.0

Tensors = dict[str, torch.Tensor]
# (float weight [N, K], module name) -> (the checkpoint's tensors for the module, keyed by suffix; the dequantized
# weight [N, K])
Quantizer = Callable[[torch.Tensor, str], tuple[Tensors, torch.Tensor]]


def make_float_model(dirpath: str | os.PathLike, family: str = "llama", seed: int = 0, **overrides: Any) -> str:
    """A tiny float32 model of `family` whose linear layers take every tested group size, with a tokenizer."""
    path = make_tiny_model(family, dirpath, seed=seed, **{**QUANT_MODEL_OVERRIDES, **overrides})
    make_tiny_tokenizer(path)
    return path


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (held in int64) as the int32 tensors checkpoints store."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along(codes: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack `codes` (0..2**bits - 1) 32 / bits to an int32 along `dim`, slot i holding feature order[i]."""
    per = 32 // bits
    order = order or tuple(range(per))
    c = codes.to(torch.int64).movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // per, per)
    words = torch.zeros(c.shape[:-1], dtype=torch.int64)
    for slot, feature in enumerate(order):
        words |= c[..., feature] << (bits * slot)
    return to_int32(words).movedim(-1, dim)


def round_to_nearest(weight: torch.Tensor, group_size: int, bits: int, sym: bool,
                     g_idx: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Groupwise integer quantization of w [N, K] as AutoGPTQ / AutoAWQ store it: (codes [N, K], scales fp16 and
    integer zeros [N, groups], dequantized [N, K]), w ~ (q - z) * s. Input feature k is in group g_idx[k]
    (default k // group_size)."""
    n, k = weight.shape
    maxq = 2**bits - 1
    g_idx = torch.arange(k) // group_size if g_idx is None else g_idx.long()
    groups = int(g_idx.max()) + 1
    scales, zeros = torch.empty(n, groups), torch.empty(n, groups)
    for g in range(groups):
        cols = weight[:, g_idx == g]
        if sym:
            scale = cols.abs().amax(dim=1) * 2 / maxq
            zero = torch.full((n,), (maxq + 1) / 2)
        else:
            low, high = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
            scale = (high - low) / maxq
            zero = torch.round(-low / scale)
        scales[:, g], zeros[:, g] = scale.half().float(), zero  # the checkpoint holds fp16 scales
    s, z = scales[:, g_idx], zeros[:, g_idx]
    q = torch.clamp(torch.round(weight / s) + z, 0, maxq)
    return q.to(torch.int64), scales.half(), zeros.to(torch.int64), (q - z) * s


def awq(group_size: int = 128, zero_point: bool = True) -> Quantizer:
    """AWQ GEMM 4-bit; without zero_point, symmetric codes around 8 (the zeros are still stored)."""

    def quantize(weight: torch.Tensor, name: str) -> tuple[Tensors, torch.Tensor]:
        q, s, z, deq = round_to_nearest(weight, group_size, 4, sym=not zero_point)
        return {"qweight": pack_along(q.t(), 4, dim=1, order=AWQ_ORDER),
                "qzeros": pack_along(z.t(), 4, dim=1, order=AWQ_ORDER), "scales": s.t().contiguous()}, deq

    return quantize


def gptq(group_size: int = 128, bits: int = 4, sym: bool = True, checkpoint_format: str = "gptq",
         desc_act: bool = False, seed: int = 0) -> Quantizer:
    """GPTQ; with desc_act the groups follow a random order of the input features, as activation order gives."""

    def quantize(weight: torch.Tensor, name: str) -> tuple[Tensors, torch.Tensor]:
        k = weight.shape[1]
        g_idx = torch.arange(k, dtype=torch.int32) // group_size
        if desc_act:
            # The order depends on the layer's input only: fused projections (same input) share it.
            same_input = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2,
                          "down_proj": 3}[name]
            order = torch.randperm(k, generator=torch.Generator().manual_seed(seed * 10 + same_input))
            g_idx = torch.empty(k, dtype=torch.int32)
            g_idx[order] = torch.arange(k, dtype=torch.int32) // group_size
        q, s, z, deq = round_to_nearest(weight, group_size, bits, sym, g_idx)
        if checkpoint_format == "gptq":
            if int(z.min()) < 1:
                raise ValueError("a zero of 0 does not survive GPTQ v1's minus-one storage; choose other weights")
            z = z - 1
        return {"qweight": pack_along(q.t(), bits, dim=0), "qzeros": pack_along(z.t(), bits, dim=1),
                "scales": s.t().contiguous(), "g_idx": g_idx}, deq

    return quantize


def fp8(per_channel: bool = False, static: bool = False) -> Quantizer:
    """FP8 e4m3 with a per-tensor or per-channel scale (the largest magnitude lands on 448)."""

    def quantize(weight: torch.Tensor, name: str) -> tuple[Tensors, torch.Tensor]:
        amax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().amax()
        scale = (amax / FP8_MAX).float()
        w8 = (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        tensors = {"weight": w8, "weight_scale": scale if per_channel else scale.reshape(())}
        if static:
            tensors["input_scale"] = torch.tensor(0.05 + 0.01 * LINEAR_MODULES.index(name))
        return tensors, w8.float() * scale

    return quantize


def quantized_pair(float_dir: str, out_dir: str | os.PathLike, quantizer: Quantizer,
                   quantization_config: dict[str, Any], keep_float: tuple[str, ...] = ()) -> tuple[str, str]:
    """Write (the quantized checkpoint, its float twin with the dequantized weights) under `out_dir`; modules whose
    name contains an entry of `keep_float` stay float in both."""
    quant_dir, twin_dir = os.path.join(out_dir, "quantized"), os.path.join(out_dir, "dequantized")
    quantized, dequantized = {}, {}
    for name, tensor in load_file(os.path.join(float_dir, "model.safetensors")).items():
        module, _, leaf = name.rpartition(".")
        kind = module.rpartition(".")[2]
        if leaf != "weight" or kind not in LINEAR_MODULES or any(k in module for k in keep_float):
            quantized[name] = dequantized[name] = tensor
            continue
        tensors, deq = quantizer(tensor.float(), kind)
        quantized.update({f"{module}.{suffix}": t.contiguous() for suffix, t in tensors.items()})
        dequantized[name] = deq.to(tensor.dtype).contiguous()
    for path, tensors, qc in ((quant_dir, quantized, quantization_config), (twin_dir, dequantized, None)):
        _copy_model_dir(float_dir, path, qc)
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return quant_dir, twin_dir


def _copy_model_dir(src: str, dst: str, quantization_config: dict[str, Any] | None) -> None:
    """config.json (with the quantization_config, as quantized checkpoints carry it) and the tokenizer files."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name not in ("model.safetensors", "config.json"):
            shutil.copy(os.path.join(src, name), dst)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
