"""From the integer codes a checkpoint packs into int32 words to vx's kernels: unpacking the words (AWQ's and GPTQ's
layouts), building the affine groupwise kernels from (codes, scale, zero), and the linear method that computes with
the packed weight once it is built."""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
from torch import nn

from vx.models.layers.quantization.base_config import LinearMethodBase, set_weight_attrs
from vx.models.layers.quantization.kernels import Int4Groupwise, Int8Groupwise

# Group sizes torch's int4 matmuls take; a larger group is the same numbers repeated over a smaller one.
_INT4_KERNEL_GROUPS = (256, 128, 64, 32)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """int32 words, each holding 32 / bits codes from the lowest bits up, along `dim` -> the codes (int32), `dim`
    32 / bits times longer. `order[i]` is which of a word's features its slot i holds (AWQ interleaves them);
    None: slot i holds feature i."""
    per_word = 32 // bits
    mask = (1 << bits) - 1
    words = packed.to(torch.int32).movedim(dim, -1)
    slots = torch.stack([(words >> (bits * i)) & mask for i in range(per_word)], dim=-1)
    if order is not None:
        if sorted(order) != list(range(per_word)):
            raise ValueError(f"order {list(order)} is not a permutation of a word's {per_word} slots.")
        inverse = [0] * per_word
        for slot, feature in enumerate(order):
            inverse[feature] = slot
        slots = slots[..., inverse]
    return slots.flatten(-2).movedim(-1, dim)


def _kernel_group(group_size: int) -> int:
    """The largest group size the int4 kernel takes that divides `group_size`."""
    for g in _INT4_KERNEL_GROUPS:
        if group_size % g == 0:
            return g
    raise ValueError(f"Groups of {group_size} input features cannot run on the 4-bit kernel (it takes groups of "
                     f"{', '.join(map(str, sorted(_INT4_KERNEL_GROUPS)))} or their multiples).")


def int4_groupwise(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                   dtype: torch.dtype) -> Int4Groupwise:
    """Int4Groupwise for w[n, k] = q[n, k] * scale[n, k // G] + zero[n, k // G] (q in 0..15), in `dtype`. A group
    larger than the kernel takes repeats its scale and zero over the kernel's groups: the same weights exactly."""
    kernel_group = _kernel_group(group_size)
    repeat = group_size // kernel_group
    if repeat > 1:
        scale, zero = scale.repeat_interleave(repeat, dim=1), zero.repeat_interleave(repeat, dim=1)
    return Int4Groupwise(q, scale.to(dtype), zero.to(dtype), kernel_group)


def int8_groupwise(q_unsigned: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                   dtype: torch.dtype) -> Int8Groupwise:
    """Int8Groupwise for w[n, k] = q[n, k] * scale[n, k // G] + zero[n, k // G] with q in 0..255: the codes move
    to -128..127 and the zero takes the 128 back."""
    q = (q_unsigned.to(torch.int32) - 128).to(torch.int8)
    return Int8Groupwise(q, scale.to(dtype), (zero + 128 * scale).to(dtype), group_size)


class PackedWeight(Protocol):
    """What kernels.py's packed weights share."""

    @property
    def nbytes(self) -> int: ...

    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...


class PackedLinearMethod(LinearMethodBase):
    """A method whose loaded weight becomes one of kernels.py's packed weights (`layer.quant_weight`), optionally
    reading the input features in another order (`layer.input_perm`: GPTQ's activation order)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not hasattr(layer, "quant_weight"):
            raise RuntimeError(f"{layer.prefix}: the weights were not readied (process_weights_after_loading).")
        perm = getattr(layer, "input_perm", None)
        # torch's packed matmuls want a contiguous input (a no-op for the usual one).
        y = layer.quant_weight.matmul(x.contiguous() if perm is None else x.index_select(-1, perm))
        return y if bias is None else y + bias


def input_groups(layer: nn.Module, input_size_per_partition: int, group_size: int) -> tuple[int, int | None]:
    """The group size of this rank's input features (`group_size`, or all of them for -1) and the dimension along
    which grouped tensors (scales, zeros) split for tensor parallelism: 0, or None for one group per row, whose
    scales do not split along the input."""
    per_row = group_size == -1
    group = input_size_per_partition if per_row else group_size
    if input_size_per_partition % group:
        raise ValueError(f"{layer.prefix}: {input_size_per_partition} input features are not whole groups of {group}.")
    return group, None if per_row else 0


def register_packed(layer: nn.Module, params: dict[str, tuple[torch.Tensor, int | None, int | None]],
                    group: int, params_dtype: torch.dtype, loaders: dict[str, Callable] | None = None) -> None:
    """Register a packed checkpoint's tensors on the layer, each {name: (empty tensor, input_dim, output_dim)} loaded
    by the layer's weight loader (or `loaders[name]`), and note its group size and activation dtype."""
    for name, (data, input_dim, output_dim) in params.items():
        param = nn.Parameter(data, requires_grad=False)
        loader = (loaders or {}).get(name, layer.weight_loader)
        set_weight_attrs(param, {"input_dim": input_dim, "output_dim": output_dim, "weight_loader": loader})
        layer.register_parameter(name, param)
    layer.quant_group_size = group
    layer.act_dtype = params_dtype


def finish_packed(layer: nn.Module, weight: PackedWeight, loaded: Sequence[str]) -> None:
    """Hand the layer its packed weight and drop the checkpoint's tensors it was built from (their memory goes)."""
    layer.quant_weight = weight
    for name in loaded:
        delattr(layer, name)
