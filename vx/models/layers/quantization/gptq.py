"""GPTQ checkpoints (AutoGPTQ / optimum / GPTQModel, as transformers and vLLM load them): 4- or 8-bit codes packed
into int32 words along the input features, a zero and a scale per group, and each input feature's group (`g_idx`).

Per layer the checkpoint holds `qweight` int32 [K / P, N] (P = 32 / bits codes a word, slot i of word j holding
input feature j * P + i), `qzeros` int32 [K / G, N / P] (packed the same way along the output), `scales`
[K / G, N] and `g_idx` int32 [K], and w[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]. Format "gptq" (v1, the
default and what nearly every checkpoint is) stores each zero minus one: the loader adds the one back, as AutoGPTQ's
and vLLM's kernels do; "gptq_v2" (GPTQModel) stores the zero itself. `sym: true` is the same layout with every zero
at the middle code (8 for 4-bit).

4-bit maps onto `Int4Groupwise` and 8-bit onto `Int8Groupwise` exactly (scale s, zero -z * s). With `desc_act` the
groups follow the activation order, so `g_idx` is a permutation of the plain k // G: the loader sorts the input
features by group, and the layer reads its input in that order (one index_select per matmul).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vx.models.layers.quantization.base_config import LinearMethodBase, QuantizationConfig, matches_module_list
from vx.models.layers.quantization.packing import (PackedLinearMethod, finish_packed, input_groups, int4_groupwise,
                                                   int8_groupwise, register_packed, unpack_int32)

_FORMATS = ("gptq", "gptq_v2")


class GPTQConfig(QuantizationConfig):
    """A GPTQ checkpoint's `quantization_config`: bits, group size, act order, zero convention, which modules."""

    name = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool, zero_offset: int,
                 modules_to_quantize: list[str] | None) -> None:
        self.bits = bits
        self.group_size = group_size
        self.desc_act = desc_act
        self.zero_offset = zero_offset  # added to each stored zero: 1 for the v1 format, 0 for v2
        self.modules_to_quantize = modules_to_quantize

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> "GPTQConfig":
        if str(quant_config.get("quant_method", "")).lower() != cls.name:
            raise ValueError("quantization='gptq' loads GPTQ checkpoints, and this one has no GPTQ "
                             "quantization_config; to quantize float weights at load use quantization='int8' or "
                             "'int4'.")
        bits = int(quant_config.get("bits", 4))
        if bits not in (4, 8):
            raise ValueError(f"GPTQ with {bits}-bit weights is not supported; vx loads 4- and 8-bit GPTQ.")
        group_size = int(quant_config.get("group_size", 128))
        if group_size != -1 and group_size <= 0:
            raise ValueError(f"GPTQ group_size={group_size} is not valid.")
        fmt = str(quant_config.get("checkpoint_format") or quant_config.get("format") or "gptq").lower()
        if fmt not in _FORMATS:
            raise ValueError(f"GPTQ checkpoint_format={fmt!r} is not supported; vx loads {', '.join(_FORMATS)}.")
        if quant_config.get("lm_head"):
            raise ValueError("GPTQ checkpoints with a quantized lm_head are not supported.")
        if quant_config.get("dynamic"):
            raise ValueError("GPTQ checkpoints with per-module overrides ('dynamic') are not supported.")
        blocks = quant_config.get("modules_in_block_to_quantize")
        modules = [name for block in blocks for name in block] if blocks else None
        return cls(bits, group_size, bool(quant_config.get("desc_act", False)), 1 if fmt == "gptq" else 0, modules)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if self.modules_to_quantize is not None and not matches_module_list(
                prefix, self.modules_to_quantize, self.packed_modules_mapping, "modules_in_block_to_quantize"):
            return None
        return GPTQLinearMethod(self)


class GPTQLinearMethod(PackedLinearMethod):
    """Loads one layer's GPTQ tensors as they are (sharded like the float weight), repacks them into
    `Int4Groupwise` (4-bit) or `Int8Groupwise` (8-bit) once loaded."""

    def __init__(self, config: GPTQConfig) -> None:
        self.config = config
        self.pack = 32 // config.bits

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        k, n, pack = input_size_per_partition, sum(output_partition_sizes), self.pack
        if k % pack or any(size % pack for size in output_partition_sizes):
            raise ValueError(f"{layer.prefix}: GPTQ {self.config.bits}-bit packs {pack} features a word, and "
                             f"{k} inputs / {output_partition_sizes} outputs are not all multiples of it.")
        group, group_dim = input_groups(layer, k, self.config.group_size)
        register_packed(layer, {
            "qweight": (torch.empty(k // pack, n, dtype=torch.int32), 0, 1),
            "qzeros": (torch.empty(k // group, n // pack, dtype=torch.int32), group_dim, 1),
            # float32 holds fp16 and bf16 scales exactly; the kernel takes them in the model dtype.
            "scales": (torch.empty(k // group, n, dtype=torch.float32), group_dim, 1),
            "g_idx": (torch.full((k,), -1, dtype=torch.int32), 0, None),
        }, group, params_dtype, loaders={"g_idx": _g_idx_loader(layer)})

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        bits, group = self.config.bits, layer.quant_group_size
        q = unpack_int32(layer.qweight.data, bits, dim=0)                                  # [K, N]
        zeros = unpack_int32(layer.qzeros.data, bits, dim=1) + self.config.zero_offset     # [K / G, N]
        scales = layer.scales.data
        # A rank that holds a slice of the input holds groups from its first one on.
        splits_input = layer.input_size_per_partition != layer.input_size and self.config.group_size != -1
        first_group = layer.tp_rank * layer.input_size_per_partition // group if splits_input else 0
        perm = _group_order(layer.g_idx.data - first_group, group, layer.prefix)
        if perm is not None:
            q = q.index_select(0, perm)
            layer.input_perm = perm
        build = int4_groupwise if bits == 4 else int8_groupwise
        kernel = build(q.t(), scales.t(), (-zeros * scales).t(), group, layer.act_dtype)
        finish_packed(layer, kernel, ("qweight", "qzeros", "scales", "g_idx"))


def _g_idx_loader(layer: nn.Module):
    """The loader of `g_idx`: every part of a fused layer brings its own, and one matmul reads its input in one
    order, so they must agree (they do: fused projections share their input, hence GPTQ's activation order)."""

    def load(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        before = param.data.clone()
        layer.weight_loader(param, loaded_weight, shard_id)
        if bool((before >= 0).any()) and not torch.equal(before, param.data):
            raise ValueError(f"{layer.prefix}: the fused projections' g_idx differ ({shard_id!r} disagrees); vx "
                             f"computes them as one matmul with one input order.")

    return load


def _group_order(g_idx: torch.Tensor, group: int, prefix: str) -> torch.Tensor | None:
    """None when input feature k is in group k // G (the plain layout); else the order that sorts the features by
    group (`desc_act`), after checking that it gives whole groups of G."""
    plain = torch.arange(g_idx.numel(), dtype=torch.int64) // group
    g = g_idx.to(torch.int64)
    if torch.equal(g, plain):
        return None
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], plain):
        raise ValueError(f"{prefix}: g_idx does not put {group} input features in each group (with desc_act and "
                         f"tensor parallelism, a rank's features can fall in any group, which vx does not support).")
    return perm
