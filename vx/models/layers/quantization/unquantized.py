"""The float path: a weight [out, in] in the model dtype, and `F.linear`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vx.models.layers.quantization.base_config import LinearMethodBase, set_weight_attrs


class UnquantizedLinearMethod(LinearMethodBase):
    """A float weight, multiplied as it is."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
                              requires_grad=False)
        set_weight_attrs(weight, {"output_dim": 0, "input_dim": 1, "weight_loader": layer.weight_loader})
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
