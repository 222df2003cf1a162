"""Tensor-parallel shaped linear layers.

Every layer stores only its own rank's shard of the weight, and each parameter carries a
`weight_loader(param, loaded_weight, shard_id=None)` that cuts that shard out of a full Hugging Face
checkpoint tensor. Only TP=1 runs today, but the shapes are already the sharded ones so that adding a
collective later changes no loading code.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

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


def _full_shape(param: torch.Tensor, dim0: int) -> tuple[int, ...]:
    """`param`'s shape with its first dim replaced by the full (all-ranks) size."""
    return (dim0, *param.shape[1:])


def _set_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


class LinearBase(nn.Module):
    """Shared parts: TP coordinates, the weight/bias parameters and the plain matmul."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_size: int = 1, tp_rank: int = 0,
                 shard_dim: int | None = None) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank} out of range for tp_size={tp_size}.")
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.input_size = input_size
        self.output_size = output_size
        # Local (this rank's) sizes.
        self.input_size_per_partition = _divide(input_size, tp_size) if shard_dim == 1 else input_size
        self.output_size_per_partition = _divide(output_size, tp_size) if shard_dim == 0 else output_size
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, self.input_size_per_partition),
                                   requires_grad=False)
        _set_loader(self.weight, self.weight_loader)
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(torch.empty(self.output_size_per_partition),
                                                          requires_grad=False)
            _set_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        """Copy the whole tensor (replicated layers); subclasses override to take their shard."""
        _copy_checked(param.data, loaded_weight, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y = x W^T + b on this rank's shard."""
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in={self.input_size_per_partition}, out={self.output_size_per_partition}, "
                f"bias={self.bias is not None}, tp={self.tp_rank}/{self.tp_size}")


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds in full."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_size: int = 1,
                 tp_rank: int = 0) -> None:
        super().__init__(input_size, output_size, bias, tp_size, tp_rank, shard_dim=None)


class ColumnParallelLinear(LinearBase):
    """Output dim split across ranks (Y = X [A_0 .. A_n]); each rank keeps its own output slice."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_size: int = 1,
                 tp_rank: int = 0) -> None:
        super().__init__(input_size, output_size, bias, tp_size, tp_rank, shard_dim=0)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        """Take rows [rank*n, (rank+1)*n) of the full weight (or bias)."""
        n = param.shape[0]
        _check_full(loaded_weight, _full_shape(param, n * self.tp_size), type(self).__name__)
        _copy_checked(param.data, loaded_weight.narrow(0, self.tp_rank * n, n), type(self).__name__)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (e.g. gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, tp_size: int = 1,
                 tp_rank: int = 0) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp_size, tp_rank)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        """Place sub-projection `shard_id` (0, 1, ...) at its offset in the fused weight."""
        if shard_id is None:  # an already fused checkpoint tensor
            raise ValueError("MergedColumnParallelLinear needs shard_id (0, 1, ...) to load a sub-projection.")
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id {shard_id} out of range for {len(self.output_sizes)} merged outputs.")
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        _check_full(loaded_weight, _full_shape(param, self.output_sizes[shard_id]),
                    f"{type(self).__name__}[{shard_id}]")
        src = loaded_weight.narrow(0, self.tp_rank * size, size)
        _copy_checked(param.data.narrow(0, offset, size), src, f"{type(self).__name__}[{shard_id}]")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused into one column-parallel weight laid out [q | k | v].

    With more ranks than KV heads, KV heads are replicated so each rank still holds at least one.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = False, tp_size: int = 1,
                 tp_rank: int = 0) -> None:
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
        super().__init__(hidden_size, output_size, bias, tp_size, tp_rank)

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
        _check_full(loaded_weight, _full_shape(param, total_heads * self.head_size),
                    f"{type(self).__name__}[{shard_id}]")
        src = loaded_weight.narrow(0, rank * size, size)
        _copy_checked(param.data.narrow(0, offset, size), src, f"{type(self).__name__}[{shard_id}]")


class RowParallelLinear(LinearBase):
    """Input dim split across ranks; partial results need an all-reduce (not wired yet, so TP must be 1)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_size: int = 1,
                 tp_rank: int = 0) -> None:
        super().__init__(input_size, output_size, bias, tp_size, tp_rank, shard_dim=1)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        """Weight: take columns of this rank. Bias: kept whole (added once after the reduce)."""
        if param.dim() == 2:
            n = param.shape[1]
            _check_full(loaded_weight, (param.shape[0], n * self.tp_size), type(self).__name__)
            loaded_weight = loaded_weight.narrow(1, self.tp_rank * n, n)
        _copy_checked(param.data, loaded_weight, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Matmul over this rank's input slice."""
        if self.tp_size > 1:
            # Without the all-reduce the result would be silently partial.
            raise NotImplementedError("RowParallelLinear with tp_size > 1 needs an all-reduce (not wired yet).")
        return F.linear(x, self.weight, self.bias)
