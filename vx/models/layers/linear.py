"""Tensor-parallel shaped linear layers, each computing through its quantization method.

Every layer stores only its own rank's shard of the weight, and each parameter carries a
`weight_loader(param, loaded_weight, shard_id=None)` that cuts that shard out of a full Hugging Face
checkpoint tensor. How the weight is stored and multiplied is the layer's `quant_method` (the float path by
default, vx/models/layers/quantization/): it creates the parameters and tags each with the dim that runs along the
layer's output features (`output_dim`) and input features (`input_dim`), so that the same loaders cut a packed
quantized tensor, its scales or a float weight. Under tensor parallelism each rank builds the sharded shapes and
RowParallelLinear sums the ranks' products over its group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from vx.models.layers.quantization.unquantized import UnquantizedLinearMethod

if TYPE_CHECKING:
    from vx.distributed import GroupCoordinator
    from vx.models.layers.quantization.base_config import QuantizationConfig

WeightLoader = Callable[..., None]


def _divide(numerator: int, denominator: int) -> int:
    """Exact division; a remainder means the model cannot be split this way."""
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor_parallel_size={denominator}.")
    return numerator // denominator


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """Copy with a shape check, so a wrong checkpoint fails loudly instead of broadcasting."""
    if param.shape != loaded.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} does not match {tuple(param.shape)}.")
    param.copy_(loaded)


def _check_full(loaded: torch.Tensor, expected: tuple[int, ...], name: str) -> None:
    """Check a full (unsharded) checkpoint tensor before cutting a shard out of it."""
    if tuple(loaded.shape) != expected:
        raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} does not match {expected}.")


def _full_shape(param: torch.Tensor, dim: int, size: int) -> tuple[int, ...]:
    """`param`'s shape with dim `dim` replaced by the full (all-ranks) size."""
    shape = list(param.shape)
    shape[dim] = size
    return tuple(shape)


def _units(param: torch.Tensor, dim: int, features: int, layer_features: int, name: str) -> int:
    """How many entries along `param`'s dim `dim` hold `features` of the layer's `layer_features` (a packed dim
    holds several features per entry, a grouped one one entry per group)."""
    scaled = param.shape[dim] * features
    if scaled % layer_features:
        raise ValueError(f"{name}: {features} of {layer_features} features do not fall on whole entries of a "
                         f"parameter of shape {tuple(param.shape)}.")
    return scaled // layer_features


def _tp(tp_group: GroupCoordinator | None, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """A layer's (tp_size, tp_rank): its group's when it has one."""
    return (tp_size, tp_rank) if tp_group is None else (tp_group.world_size, tp_group.rank_in_group)


class LinearBase(nn.Module):
    """Shared parts: TP coordinates, the quantization method that owns the weight, the bias, the forward."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_size: int = 1, tp_rank: int = 0,
                 shard_dim: int | None = None, quant_config: QuantizationConfig | None = None, prefix: str = "",
                 output_partition_sizes: list[int] | None = None, tp_group: GroupCoordinator | None = None) -> None:
        super().__init__()
        self.tp_group = tp_group
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank} out of range for tp_size={tp_size}.")
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.input_size = input_size
        self.output_size = output_size
        self.prefix = prefix
        # Local (this rank's) sizes.
        self.input_size_per_partition = _divide(input_size, tp_size) if shard_dim == 1 else input_size
        self.output_size_per_partition = _divide(output_size, tp_size) if shard_dim == 0 else output_size
        # The fused projections' sizes on this rank (one entry for an unfused layer).
        self.output_partition_sizes = output_partition_sizes or [self.output_size_per_partition]
        method = quant_config.get_linear_method(self, prefix) if quant_config is not None else None
        self.quant_method = method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, self.input_size_per_partition, self.output_partition_sizes,
                                         input_size, output_size, torch.get_default_dtype())
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(torch.empty(self.output_size_per_partition),
                                                          requires_grad=False)
            self.bias.output_dim = 0  # type: ignore[attr-defined]
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        """Copy the whole tensor (replicated layers); subclasses override to take their shard."""
        _copy_checked(param.data, loaded_weight, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y = x W^T + b on this rank's shard, through the quantization method."""
        return self.quant_method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        return (f"in={self.input_size_per_partition}, out={self.output_size_per_partition}, "
                f"bias={self.bias is not None}, tp={self.tp_rank}/{self.tp_size}, "
                f"method={type(self.quant_method).__name__}")

    def _load_output_shard(self, param: nn.Parameter, loaded_weight: torch.Tensor, offset: int, size: int,
                           full_size: int, rank: int, name: str) -> None:
        """Copy features [rank * size, (rank + 1) * size) of a checkpoint tensor holding `full_size` output
        features to features [offset, offset + size) of this rank's `param`, along the param's `output_dim`."""
        dim = getattr(param, "output_dim", None)
        if dim is None:  # does not split along the output (a per-tensor scale)
            _copy_checked(param.data, loaded_weight, name)
            return
        layer = self.output_size_per_partition
        size_p, offset_p = _units(param, dim, size, layer, name), _units(param, dim, offset, layer, name)
        _check_full(loaded_weight, _full_shape(param, dim, _units(param, dim, full_size, layer, name)), name)
        _copy_checked(param.data.narrow(dim, offset_p, size_p), loaded_weight.narrow(dim, rank * size_p, size_p),
                      name)


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds in full."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_size: int = 1,
                 tp_rank: int = 0, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__(input_size, output_size, bias, tp_size, tp_rank, shard_dim=None, quant_config=quant_config,
                         prefix=prefix)


class ColumnParallelLinear(LinearBase):
    """Output dim split across ranks (Y = X [A_0 .. A_n]); each rank keeps its own output slice."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_size: int = 1,
                 tp_rank: int = 0, quant_config: QuantizationConfig | None = None, prefix: str = "",
                 output_partition_sizes: list[int] | None = None, tp_group: GroupCoordinator | None = None) -> None:
        tp_size, tp_rank = _tp(tp_group, tp_size, tp_rank)
        super().__init__(input_size, output_size, bias, tp_size, tp_rank, shard_dim=0, quant_config=quant_config,
                         prefix=prefix, output_partition_sizes=output_partition_sizes, tp_group=tp_group)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        """Take this rank's output features [rank*n, (rank+1)*n) of the full weight (or bias, or scales)."""
        n = self.output_size_per_partition
        self._load_output_shard(param, loaded_weight, 0, n, n * self.tp_size, self.tp_rank, type(self).__name__)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (e.g. gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, tp_size: int = 1,
                 tp_rank: int = 0, quant_config: QuantizationConfig | None = None, prefix: str = "",
                 tp_group: GroupCoordinator | None = None) -> None:
        tp_size, tp_rank = _tp(tp_group, tp_size, tp_rank)
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp_size, tp_rank, quant_config, prefix,
                         [_divide(size, tp_size) for size in output_sizes], tp_group)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        """Place sub-projection `shard_id` (0, 1, ...) at its offset in the fused weight."""
        if shard_id is None:  # an already fused checkpoint tensor
            raise ValueError("MergedColumnParallelLinear needs shard_id (0, 1, ...) to load a sub-projection.")
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id {shard_id} out of range for {len(self.output_sizes)} merged outputs.")
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        self._load_output_shard(param, loaded_weight, offset, size, self.output_sizes[shard_id], self.tp_rank,
                                f"{type(self).__name__}[{shard_id}]")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused into one column-parallel weight laid out [q | k | v].

    With more ranks than KV heads, KV heads are replicated so each rank still holds at least one.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = False, tp_size: int = 1,
                 tp_rank: int = 0, quant_config: QuantizationConfig | None = None, prefix: str = "",
                 tp_group: GroupCoordinator | None = None) -> None:
        tp_size, tp_rank = _tp(tp_group, tp_size, tp_rank)
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = _divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        # Sized so that the per-rank output is q_size + 2 * kv_size even with replicated KV heads.
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_size
        super().__init__(hidden_size, output_size, bias, tp_size, tp_rank, quant_config, prefix,
                         [self.q_size, self.kv_size, self.kv_size], tp_group)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        """Place this rank's part of the full q, k or v checkpoint tensor (shard_id 'q'|'k'|'v')."""
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, rank = self.kv_size, self.tp_rank // self.num_kv_head_replicas
        else:
            raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}.")
        total_heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        self._load_output_shard(param, loaded_weight, offset, size, total_heads * self.head_size, rank,
                                f"{type(self).__name__}[{shard_id}]")


class RowParallelLinear(LinearBase):
    """Input dim split across ranks; the ranks' partial products are summed (all-reduce over `tp_group`), then
    the bias is added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_size: int = 1,
                 tp_rank: int = 0, quant_config: QuantizationConfig | None = None, prefix: str = "",
                 tp_group: GroupCoordinator | None = None) -> None:
        tp_size, tp_rank = _tp(tp_group, tp_size, tp_rank)
        super().__init__(input_size, output_size, bias, tp_size, tp_rank, shard_dim=1, quant_config=quant_config,
                         prefix=prefix, tp_group=tp_group)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        """Weight (and its scales): take this rank's input features, along the param's `input_dim`. Bias: kept
        whole (added once after the reduce)."""
        dim = getattr(param, "input_dim", None)
        if dim is not None:
            name = type(self).__name__
            n = param.shape[dim]
            _check_full(loaded_weight, _full_shape(param, dim, n * self.tp_size), name)
            loaded_weight = loaded_weight.narrow(dim, self.tp_rank * n, n)
        _copy_checked(param.data, loaded_weight, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Matmul over this rank's input slice, summed over the ranks, plus the bias."""
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        if self.tp_group is None:
            # Without the all-reduce the result would be silently partial.
            raise ValueError(f"{self.prefix}: tp_size={self.tp_size} without a tp_group to sum the ranks over.")
        y = self.tp_group.all_reduce(self.quant_method.apply(self, x, None))
        return y if self.bias is None else y + self.bias
