"""A GGUF file's tensors under the Hugging Face names vx's models load, straight from the file.

`gguf.GGUFReader` memory-maps the file and hands out numpy views: nothing is copied or dequantized here. A weight
(2-D) arrives as its raw rows of bytes, `<module>.qweight`, after its ggml type, `<module>.qweight_type`, for the
layer's GGUF method to repack; a norm (1-D, always float in GGUF) arrives as a float tensor under its own name. The
names come from the gguf package's map (HF module -> GGUF tensor), reversed. llama.cpp stores a llama-architecture
file's q and k rows permuted for its rotary layout; the rows are put back in Hugging Face's order here, which moves
whole rows of blocks and so is exact for every type.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterator

import numpy as np
import torch

from vx.config import hf_num_kv_heads
from vx.models.layers.quantization.gguf_blocks import FLOAT_TYPES, SUPPORTED_TYPES, type_name

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
"""GGUF `general.architecture`s vx loads (llama.cpp writes Mistral models as "llama")."""

# llama.cpp's converter permutes q/k rows for these architectures (its LlamaModel); Qwen files keep HF's order.
_PERMUTED_ARCHITECTURES = ("llama",)

# The Hugging Face modules of a Llama-family checkpoint, as the safetensors path names them.
_MODEL_MODULES = ("model.embed_tokens", "model.norm", "lm_head")
_LAYER_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                  "input_layernorm", "post_attention_layernorm")


def gguf_to_hf_names(architecture: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor base name ("blk.0.attn_q") -> Hugging Face module ("model.layers.0.self_attn.q_proj")."""
    import gguf

    arch = next((key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise ValueError(f"The gguf package does not know the architecture {architecture!r}.")
    name_map = gguf.get_tensor_name_map(arch, num_layers)
    modules = [*_MODEL_MODULES, *(f"model.layers.{i}.{m}" for i in range(num_layers) for m in _LAYER_MODULES)]
    names: dict[str, str] = {}
    for module in modules:
        gguf_name = name_map.get_name(module)
        if gguf_name is not None:
            names[gguf_name] = module
    return names


def unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of q or k rows (per head: the two interleaved halves back to halves)."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


class GGUFWeights:
    """The tensors of one GGUF file as (Hugging Face name, tensor) pairs for `load_weights`.

    Opening checks the whole file against what vx loads (architecture, every tensor's type), so an unsupported
    file fails before the model is built.
    """

    def __init__(self, path: str, hf_config: Any) -> None:
        from gguf import GGUFReader

        if not os.path.isfile(path):
            raise ValueError(f"GGUF file {path!r} does not exist (the model's config.json points at it).")
        try:
            # Copy-on-write: writable numpy views for torch, and the file is never written.
            self.reader = GGUFReader(path, mode="c")
            field = self.reader.fields["general.architecture"]
            self.architecture = bytes(field.parts[field.data[0]]).decode("utf-8")
        except Exception as e:  # the gguf package raises many kinds on a bad file
            raise ValueError(f"{path!r} is not a readable GGUF file: {e}") from e
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"GGUF architecture {self.architecture!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}.")
        self.path = path
        self.num_heads = int(hf_config.num_attention_heads)
        self.num_kv_heads = hf_num_kv_heads(hf_config)
        names = gguf_to_hf_names(self.architecture, int(hf_config.num_hidden_layers))
        self.tensors: list[tuple[str, Any]] = []  # (HF module, reader tensor)
        unknown = []
        for tensor in self.reader.tensors:
            base, _, suffix = tensor.name.rpartition(".")
            module = names.get(base)
            if module is None or suffix not in ("weight", "bias"):
                unknown.append(tensor.name)
                continue
            self._check_type(tensor)
            self.tensors.append((module, tensor))
        if unknown:
            logger.warning("Ignoring GGUF tensors vx's model has no place for: %s.", ", ".join(unknown))

    def _check_type(self, tensor: Any) -> None:
        ggml_type = int(tensor.tensor_type)
        if ggml_type not in SUPPORTED_TYPES:
            raise ValueError(f"GGUF tensor {tensor.name!r} in {self.path!r} has type {type_name(ggml_type)}, which vx "
                             f"cannot load; vx loads {', '.join(type_name(t) for t in SUPPORTED_TYPES)}.")
        if tensor.data.ndim == 1 and ggml_type not in FLOAT_TYPES:
            raise ValueError(f"GGUF tensor {tensor.name!r} in {self.path!r} is 1-D of type {type_name(ggml_type)}; "
                             "vx expects 1-D tensors (norms, biases) in a float type.")

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for module, tensor in self.tensors:
            suffix = tensor.name.rpartition(".")[2]
            ggml_type = int(tensor.tensor_type)
            data = tensor.data.view(np.uint8)  # rows of bytes (the bytes, for a 1-D tensor), whatever the type
            if self.architecture in _PERMUTED_ARCHITECTURES and module.endswith((".q_proj", ".k_proj")):
                # Weights and biases alike: the permutation is of the output features.
                data = unpermute_rows(data.reshape(tensor.data.shape[0], -1),
                                      self.num_heads if module.endswith(".q_proj") else self.num_kv_heads)
                data = data.reshape(-1) if tensor.data.ndim == 1 else data
            if tensor.data.ndim == 1:  # a norm or a bias: float, under its own name
                yield f"{module}.{suffix}", torch.from_numpy(data).view(FLOAT_TYPES[ggml_type])
            elif suffix == "bias":
                raise ValueError(f"GGUF tensor {tensor.name!r} is a 2-D bias; vx expects biases 1-D.")
            else:
                yield f"{module}.qweight_type", torch.tensor(ggml_type)
                yield f"{module}.qweight", torch.from_numpy(data)
