"""Quantizing a float checkpoint at load (`quantization="int8"` / `"int4"`): weight-only, round to nearest, the
activations stay in the model dtype.

- int4: `Int4Groupwise`, asymmetric (a scale and a zero per group of INT4_GROUP_SIZE input features: the group's
  minimum and its range over 15 steps), so each group's extremes are represented exactly.
- int8: `Int8PerChannel`, symmetric (one scale per output row: its largest magnitude over 127, so no weight moves
  by more than 0.4% of its row's largest). Groups of 32 measured no better on the default model and take a quarter
  more memory, and this layout has torch's own int8 matmul behind it.

docs/quantization.md has the measurements behind both choices.

Each layer is quantized as soon as its last part is loaded, and its float weight is let go at once: the whole float
model never exists, only one layer of it at a time (plus the weights not yet reached, which the allocator has not
touched). The LM head and the embedding stay in the model dtype.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from vx.models.layers.quantization.base_config import LinearMethodBase, QuantizationConfig, set_weight_attrs
from vx.models.layers.quantization.kernels import Int8PerChannel
from vx.models.layers.quantization.packing import PackedLinearMethod, PackedWeight, finish_packed, int4_groupwise

INT4_GROUP_SIZE = 32
"""Input features per int4 group: the smallest the kernel takes, measured the most accurate, and a divisor of every
hidden size that is a multiple of 32 (the default model's 576 is not a multiple of 128)."""


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor,
                                                                                      torch.Tensor]:
    """w [N, K] -> (q [N, K] in 0..15, scale, zero [N, K / G]) with w ~ q * scale + zero (float32)."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = (high - low) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: every code 0, zero = the value
    q = ((groups - low[..., None]) / safe[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, low


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] int8 in -127..127, scale [N]) with w ~ q * scale (float32)."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (w / safe[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


class WeightOnlyConfig(QuantizationConfig):
    """Quantize every linear layer's float weight at load; `bits` 8 or 4."""

    bits: int

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> "WeightOnlyConfig":
        # get_quantization_config has refused a checkpoint quantized otherwise; nothing to read.
        return cls()

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        return WeightOnlyLinearMethod(self.bits)


class Int8Config(WeightOnlyConfig):
    """`quantization="int8"`."""

    name = "int8"
    bits = 8


class Int4Config(WeightOnlyConfig):
    """`quantization="int4"`."""

    name = "int4"
    bits = 4


class WeightOnlyLinearMethod(PackedLinearMethod):
    """A float weight loaded like the float path's, quantized when its last part is in."""

    def __init__(self, bits: int) -> None:
        self.bits = bits

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        if self.bits == 4 and input_size_per_partition % INT4_GROUP_SIZE:
            raise ValueError(f"{layer.prefix}: quantization='int4' takes groups of {INT4_GROUP_SIZE} input "
                             f"features, and the layer has {input_size_per_partition}.")
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
                              requires_grad=False)
        set_weight_attrs(weight, {"output_dim": 0, "input_dim": 1, "weight_loader": self._loader(layer)})
        layer.register_parameter("weight", weight)
        layer.act_dtype = params_dtype

    def _loader(self, layer: nn.Module) -> Callable[..., None]:
        """The layer's loader; once every part has arrived, quantize and let the float weight go."""
        parts_seen: set[Any] = set()

        def load(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
            layer.weight_loader(param, loaded_weight, shard_id)
            parts_seen.add(shard_id)
            if len(parts_seen) == len(layer.output_partition_sizes):
                self.process_weights_after_loading(layer)
                param.data = torch.empty(0, dtype=param.dtype)  # the loader's own reference to it, too

        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if hasattr(layer, "quant_weight"):  # done when the last part arrived
            return
        finish_packed(layer, self.quantize(layer.weight.data, layer.act_dtype), ("weight",))

    def quantize(self, weight: torch.Tensor, dtype: torch.dtype) -> PackedWeight:
        """The packed form of a float weight [N, K], its scales in `dtype`."""
        if self.bits == 4:
            q, scale, zero = quantize_int4(weight)
            return int4_groupwise(q, scale, zero, INT4_GROUP_SIZE, dtype)
        q, scale = quantize_int8(weight)
        return Int8PerChannel(q, scale.to(dtype))
