"""AWQ checkpoints (AutoAWQ's GEMM format, as transformers and vLLM load them): 4-bit codes packed eight to an int32
along the output features in AWQ's interleaved order, a zero and a scale per group of input features.

Per layer the checkpoint holds `qweight` int32 [K, N / 8], `qzeros` int32 [K / G, N / 8] and `scales` fp16
[K / G, N] (K input, N output features, G the group size), and w[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]:
affine 4-bit per group, which `Int4Groupwise` is exactly (scale s, zero -z * s). A word's eight slots, lowest bits
first, hold the features 0, 2, 4, 6, 1, 3, 5, 7 of its eight (AutoAWQ's `order_map`). With `zero_point: false` the
zeros are still stored (all 8), so one path reads both.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vx.models.layers.quantization.base_config import LinearMethodBase, QuantizationConfig, matches_module_list
from vx.models.layers.quantization.packing import (PackedLinearMethod, finish_packed, input_groups, int4_groupwise,
                                                   register_packed, unpack_int32)

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""The feature each slot of an AWQ word holds, slot 0 in the lowest 4 bits."""

_PACK = 8  # 4-bit codes per int32


class AWQConfig(QuantizationConfig):
    """An AWQ checkpoint's `quantization_config`: 4-bit, GEMM layout, a group size, modules left in float."""

    name = "awq"

    def __init__(self, group_size: int, zero_point: bool, modules_to_not_convert: list[str]) -> None:
        self.group_size = group_size
        self.zero_point = zero_point
        self.modules_to_not_convert = modules_to_not_convert

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> "AWQConfig":
        if str(quant_config.get("quant_method", "")).lower() != cls.name:
            raise ValueError("quantization='awq' loads AWQ checkpoints, and this one has no AWQ quantization_config; "
                             "to quantize float weights at load use quantization='int8' or 'int4'.")
        # transformers writes bits/group_size/version, AutoAWQ's own quant_config w_bit/q_group_size/version.
        bits = int(quant_config.get("bits", quant_config.get("w_bit", 4)))
        if bits != 4:
            raise ValueError(f"AWQ with {bits}-bit weights is not supported; vx loads 4-bit AWQ.")
        layout = str(quant_config.get("version", quant_config.get("format", "gemm"))).lower()
        if layout != "gemm":
            raise ValueError(f"AWQ checkpoints in the {layout!r} layout are not supported; vx loads the 'gemm' "
                             f"layout (AutoAWQ's default).")
        group_size = int(quant_config.get("group_size", quant_config.get("q_group_size", 128)))
        if group_size != -1 and (group_size <= 0 or group_size % 32):
            raise ValueError(f"AWQ group_size={group_size} is not supported; vx loads -1 (one group per row) and "
                             f"multiples of 32.")
        return cls(group_size, bool(quant_config.get("zero_point", True)),
                   list(quant_config.get("modules_to_not_convert") or []))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if matches_module_list(prefix, self.modules_to_not_convert, self.packed_modules_mapping,
                               "modules_to_not_convert"):
            return None
        return AWQLinearMethod(self)


class AWQLinearMethod(PackedLinearMethod):
    """Loads one layer's AWQ tensors as they are (sharded like the float weight), repacks them into
    `Int4Groupwise` once loaded."""

    def __init__(self, config: AWQConfig) -> None:
        self.config = config

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        k, n = input_size_per_partition, sum(output_partition_sizes)
        if any(size % _PACK for size in output_partition_sizes):
            raise ValueError(f"{layer.prefix}: AWQ packs 8 output features a word, and {output_partition_sizes} "
                             f"are not all multiples of 8.")
        group, group_dim = input_groups(layer, k, self.config.group_size)
        register_packed(layer, {
            "qweight": (torch.empty(k, n // _PACK, dtype=torch.int32), 0, 1),
            "qzeros": (torch.empty(k // group, n // _PACK, dtype=torch.int32), group_dim, 1),
            # float32 holds fp16 and bf16 scales exactly; the kernel takes them in the model dtype.
            "scales": (torch.empty(k // group, n, dtype=torch.float32), group_dim, 1),
        }, group, params_dtype)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q = unpack_int32(layer.qweight.data, 4, dim=1, order=AWQ_PACK_ORDER)      # [K, N]
        zeros = unpack_int32(layer.qzeros.data, 4, dim=1, order=AWQ_PACK_ORDER)   # [K / G, N]
        scales = layer.scales.data
        kernel = int4_groupwise(q.t(), scales.t(), (-zeros * scales).t(), layer.quant_group_size, layer.act_dtype)
        finish_packed(layer, kernel, ("qweight", "qzeros", "scales"))
