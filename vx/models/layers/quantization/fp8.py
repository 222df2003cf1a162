"""FP8 checkpoints (`quant_method: "fp8"`, as vLLM and llm-compressor write them): float8_e4m3fn weights with a
float32 `weight_scale` per tensor (one number) or per output channel ([N] or [N, 1]); w = weight * weight_scale.

A fused layer (q/k/v, gate/up) gets one per-tensor scale per part: the method keeps a scale per output channel and
fills each part's channels with its part's scale, so the order in which a part's weight and scale arrive does not
matter (the weight is scaled once everything is in). With `activation_scheme: "static"` the checkpoint also has an
`input_scale` per part: it is read and set aside, because activations stay in the model dtype here (only the
native path below quantizes them, per token, which is at least as precise).

Where it runs: a CPU has no FP8 matmul, so the weight is dequantized once at load into the model dtype, exact
(every e4m3 value times a float32 scale is a float32 number). On CUDA with FP8 tensor cores (compute capability 9.0+,
bf16 activations) the weight stays FP8 and `torch._scaled_mm` multiplies with row-wise scales: written to torch's
documented contract but untested (no such GPU where this was written). Block-wise FP8 (`weight_block_size`) is
refused.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from vx.models.layers.quantization.base_config import (LinearMethodBase, QuantizationConfig, matches_module_list,
                                                       set_weight_attrs)

_FP8 = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(_FP8).max)
_QKV_SHARDS = {"q": 0, "k": 1, "v": 2}


class Fp8Config(QuantizationConfig):
    """An FP8 checkpoint's `quantization_config`: activation scheme and the layers left in float."""

    name = "fp8"

    def __init__(self, activation_scheme: str, ignored_layers: list[str]) -> None:
        self.activation_scheme = activation_scheme
        self.ignored_layers = ignored_layers

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> "Fp8Config":
        if str(quant_config.get("quant_method", "")).lower() != cls.name:
            raise ValueError("quantization='fp8' loads FP8 checkpoints, and this one has no FP8 quantization_config; "
                             "to quantize float weights at load use quantization='int8' or 'int4'.")
        block = quant_config.get("weight_block_size")
        if block:
            raise ValueError(f"Block-wise FP8 checkpoints (weight_block_size={block}) are not supported; vx loads "
                             f"FP8 with a scale per tensor or per output channel.")
        scheme = str(quant_config.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("static", "dynamic"):
            raise ValueError(f"FP8 activation_scheme={scheme!r} is not supported; vx loads 'static' and 'dynamic'.")
        # vLLM's writers call the float layers ignored_layers, transformers' modules_to_not_convert.
        ignored = list(quant_config.get("ignored_layers") or []) + list(quant_config.get("modules_to_not_convert")
                                                                        or [])
        return cls(scheme, ignored)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if matches_module_list(prefix, self.ignored_layers, self.packed_modules_mapping, "ignored_layers"):
            return None
        return Fp8LinearMethod(self)


def native_fp8(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether FP8 weights multiply natively here (`torch._scaled_mm` with row-wise scales: CUDA 9.0+, bf16)."""
    return (device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) >= (9, 0))


class Fp8LinearMethod(LinearMethodBase):
    """One layer's FP8 weight and its scales: dequantized at load (CPU), or multiplied as FP8 (see native_fp8)."""

    def __init__(self, config: Fp8Config) -> None:
        self.config = config

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        n = sum(output_partition_sizes)
        weight = nn.Parameter(torch.empty(n, input_size_per_partition, dtype=_FP8), requires_grad=False)
        set_weight_attrs(weight, {"output_dim": 0, "input_dim": 1, "weight_loader": _fp8_weight_loader(layer)})
        layer.register_parameter("weight", weight)
        scale = nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(scale, {"output_dim": 0, "weight_loader": _weight_scale_loader(layer)})
        layer.register_parameter("weight_scale", scale)
        if self.config.activation_scheme == "static":
            input_scale = nn.Parameter(torch.empty(len(output_partition_sizes), dtype=torch.float32),
                                       requires_grad=False)
            set_weight_attrs(input_scale, {"weight_loader": _input_scale_loader(layer)})
            layer.register_parameter("input_scale", input_scale)
        layer.act_dtype = params_dtype

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight, scale = layer.weight.data, layer.weight_scale.data
        if hasattr(layer, "input_scale"):
            del layer.input_scale  # activations are not quantized with it (module docstring)
        k, n = weight.shape[1], weight.shape[0]
        if native_fp8(weight.device, layer.act_dtype) and k % 16 == 0 and n % 16 == 0:
            layer.fp8_native = True
            return
        del layer.weight, layer.weight_scale
        dequantized = (weight.to(torch.float32) * scale[:, None]).to(layer.act_dtype)
        layer.register_parameter("weight", nn.Parameter(dequantized, requires_grad=False))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not getattr(layer, "fp8_native", False):
            return F.linear(x, layer.weight, bias)
        shape = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        # Per-token activation scales: the row's largest magnitude lands on e4m3's largest finite value.
        x_scale = (x2.abs().amax(dim=1, keepdim=True).float() / _FP8_MAX).clamp(min=1e-12)
        x_fp8 = (x2.float() / x_scale).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8)
        y = torch._scaled_mm(x_fp8, layer.weight.t(), scale_a=x_scale, scale_b=layer.weight_scale.view(1, -1),
                             out_dtype=x.dtype)
        if bias is not None:  # added apart: not every row-wise _scaled_mm build takes a bias
            y = y + bias
        return y.reshape(*shape, y.shape[-1])


def _shard_index(shard_id: Any) -> int:
    """The position of a fused layer's part: q/k/v -> 0/1/2, gate/up -> 0/1, an unfused layer's one part -> 0."""
    if shard_id is None:
        return 0
    return _QKV_SHARDS[shard_id] if isinstance(shard_id, str) else int(shard_id)


def _fp8_weight_loader(layer: nn.Module) -> Callable[..., None]:
    """The layer's loader, for e4m3 tensors only (copying another dtype in would convert it silently)."""

    def load(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if loaded_weight.dtype != _FP8:
            raise ValueError(f"{layer.prefix}: an FP8 checkpoint's weight is {loaded_weight.dtype}; vx loads "
                             f"float8_e4m3fn.")
        layer.weight_loader(param, loaded_weight, shard_id)

    return load


def _weight_scale_loader(layer: nn.Module) -> Callable[..., None]:
    """A per-tensor scale (one number) fills its part's output channels; a per-channel one is cut like the
    weight's rows."""

    def load(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if loaded_weight.numel() == 1:
            i = _shard_index(shard_id)
            sizes = layer.output_partition_sizes
            param.data.narrow(0, sum(sizes[:i]), sizes[i]).fill_(loaded_weight.item())
        else:
            layer.weight_loader(param, loaded_weight.reshape(-1), shard_id)

    return load


def _input_scale_loader(layer: nn.Module) -> Callable[..., None]:
    """One static activation scale per part."""

    def load(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if loaded_weight.numel() != 1:
            raise ValueError(f"{layer.prefix}: input_scale has shape {tuple(loaded_weight.shape)}; vx loads one "
                             f"static activation scale per tensor.")
        param.data[_shard_index(shard_id)] = loaded_weight.item()

    return load
