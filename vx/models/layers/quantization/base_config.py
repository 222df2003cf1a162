"""What a quantization method is to the layers: a `QuantizationConfig` read from the checkpoint (or the engine
args) hands each layer a method that creates its weights, loads them, readies them for the kernel once, and
computes with them (vLLM's `QuantizationConfig` / `LinearMethodBase` split)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import MappingProxyType
from typing import Any, ClassVar, Iterable, Mapping

import torch
from torch import nn


class LinearMethodBase(ABC):
    """How one linear layer holds and multiplies its weight.

    `create_weights` registers the layer's parameters (this rank's shard) and tags each with where its output and
    input dims are (`set_weight_attrs`), so that the layer's shard-aware `weight_loader` cuts checkpoint tensors
    the same way for every format. `process_weights_after_loading` runs once, after the whole checkpoint is in:
    the place to repack into a kernel's layout. `apply` computes x W^T (+ bias) in x's dtype.
    """

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype) -> None: ...

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - optional hook
        """Repack what was loaded into the kernel's layout (once)."""


class EmbeddingMethodBase(ABC):
    """How a token embedding (and an LM head that shares or mirrors it) holds a quantized table: rows gathered by
    id for the embedding, a matmul for the head."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, num_embeddings_per_partition: int, embedding_dim: int,
                       params_dtype: torch.dtype) -> None: ...

    @abstractmethod
    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - optional hook
        """Repack what was loaded into the kernel's layout (once)."""


class QuantizationConfig(ABC):
    """One checkpoint's quantization: which layers are quantized, and with what method."""

    name: ClassVar[str]
    packed_modules_mapping: Mapping[str, tuple[str, ...]] = MappingProxyType({})
    """Fused layer name -> the checkpoint modules it fuses ("qkv_proj" -> q/k/v_proj): the model class's, set by the
    loader before the model is built, so that a list of checkpoint module names reaches the fused layers."""

    @classmethod
    @abstractmethod
    def from_config(cls, quant_config: dict[str, Any]) -> "QuantizationConfig":
        """From a checkpoint's `quantization_config` ({} when the method was asked for by `quantization=`);
        `ValueError` for a variant this method does not support, naming it."""

    def verify(self, device: torch.device, dtype: torch.dtype) -> None:  # noqa: B027 - optional check
        """`ValueError` when this method cannot run on `device` with activations in `dtype`."""

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        """The method for the linear layer named `prefix` (e.g. "model.layers.0.self_attn.qkv_proj"); None
        leaves it unquantized."""

    def get_embedding_method(self, layer: nn.Module, prefix: str) -> EmbeddingMethodBase | None:
        """The method for a token embedding or LM head; None (the default) leaves it in the model dtype."""
        return None

    def weights(self, model_path: str, hf_config: Any) -> Iterable[tuple[str, torch.Tensor]] | None:
        """The checkpoint's (name, tensor) pairs when this format keeps them elsewhere than the directory's
        safetensors files (a GGUF file); None (the default): the safetensors files. Called before the model is
        built, so a bad source fails before anything is allocated."""
        return None


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    """Tag a parameter for the loaders: `output_dim` / `input_dim` (which of its dims runs along the layer's
    output / input features; None: it does not split), `weight_loader`, and any method-specific facts."""
    for key, value in attrs.items():
        setattr(param, key, value)


def checkpoint_module_names(prefix: str, packed_modules_mapping: Mapping[str, tuple[str, ...]]) -> list[str]:
    """The checkpoint's names for the layer `prefix`: the modules a fused layer fuses, else `prefix` itself."""
    parent, _, leaf = prefix.rpartition(".")
    parts = packed_modules_mapping.get(leaf)
    if not parts:
        return [prefix]
    return [f"{parent}.{part}" if parent else part for part in parts]


def matches_module_list(prefix: str, names: Iterable[str], packed_modules_mapping: Mapping[str, tuple[str, ...]],
                        what: str) -> bool:
    """Whether a checkpoint's list of module names (`modules_to_not_convert` and the like: an entry names every
    module whose name contains it, as AutoAWQ and transformers read them) takes in the layer `prefix`. A fused layer
    is taken in when all its parts are; only some of them is a `ValueError` (one matmul cannot mix formats)."""
    names = [str(n) for n in names]
    hits = [any(n in part for n in names) for part in checkpoint_module_names(prefix, packed_modules_mapping)]
    if any(hits) and not all(hits):
        raise ValueError(f"The checkpoint's {what} takes in only some of the modules fused into {prefix}; vx "
                         f"computes them as one matmul and cannot mix quantized and float parts.")
    return all(hits)
