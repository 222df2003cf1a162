"""A GGUF file's tensors under the Hugging Face names vx's models load, straight from the file.

Each tensor is memory-mapped where the file's header (vx/models/gguf_header.py) says it lies and handed out as a
view: nothing is copied or dequantized here. A weight (2-D) arrives as its raw rows of bytes, `<module>.qweight`,
after its ggml type, `<module>.qweight_type`, for the layer's GGUF method to repack; a norm or bias (1-D, always
float in GGUF) arrives as a float tensor under its own name. The names come from the gguf package's map (HF module
-> GGUF tensor), reversed. llama.cpp stores a llama-architecture file's q and k rows permuted for its rotary layout;
the rows are put back in Hugging Face's order here, which moves whole rows of blocks and so is exact for every type.

Each tensor has a mapping of its own, let go with the last view of it (once its layer is readied). The token
embedding is read a few rows per step for as long as the model runs, so the model keeps its view: `close()` (when
loading ends) drops the pages repacking read from it, and afterwards only the rows batches look up are resident.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch

from vx.config import hf_num_kv_heads
from vx.models.gguf_header import TensorInfo, read_gguf_header
from vx.models.layers.quantization.gguf_blocks import FLOAT_TYPES, SUPPORTED_TYPES, row_bytes, type_name

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
"""GGUF `general.architecture`s vx loads (llama.cpp writes Mistral models as "llama")."""

# llama.cpp's converter stores these architectures' norm weights as 1 + the checkpoint's (Gemma keeps offsets
# from 1): the offset comes off as they load.
_NORMS_PLUS_ONE = ("gemma3",)

# llama.cpp's converter permutes q/k rows for these architectures (its LlamaModel); Qwen files keep HF's order.
_PERMUTED_ARCHITECTURES = ("llama",)

# The Hugging Face modules of a Llama-family checkpoint, as the safetensors path names them.
_MODEL_MODULES = ("model.embed_tokens", "model.norm", "lm_head")
# Tables the model keeps as they arrive, read a few rows at a time (the token embedding's lookups).
_KEPT_TABLES = ("model.embed_tokens",)
_LAYER_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                  "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


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


class _Entry(NamedTuple):
    """Where one tensor lies in the file, and what vx's model calls it."""

    module: str  # HF module name
    suffix: str  # "weight" or "bias"
    name: str  # GGUF name
    ggml_type: int
    offset: int  # of its first byte in the file
    shape: tuple[int, ...]  # in bytes: (rows, bytes per row), or (bytes,) for a 1-D tensor


class GGUFWeights:
    """The tensors of one GGUF file as (Hugging Face name, tensor) pairs for `load_weights`.

    Opening checks the whole file against what vx loads (architecture, every tensor's type), so an unsupported
    file fails before the model is built. Each tensor is mapped on its own, so a layer's part of the file is let go
    once the layer is readied.
    """

    def __init__(self, path: str, hf_config: Any) -> None:
        if not os.path.isfile(path):
            raise ValueError(f"GGUF file {path!r} does not exist (the model's config.json points at it).")
        header = read_gguf_header(path)
        self.architecture = header.architecture
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"GGUF architecture {self.architecture!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}.")
        self.path = path
        self.num_heads = int(hf_config.num_attention_heads)
        self.num_kv_heads = hf_num_kv_heads(hf_config)
        names = gguf_to_hf_names(self.architecture, int(hf_config.num_hidden_layers))
        self.entries: list[_Entry] = []
        unknown = []
        for info in header.tensors:
            base, _, suffix = info.name.rpartition(".")
            module = names.get(base)
            if module is None or suffix not in ("weight", "bias"):
                unknown.append(info.name)
                continue
            self.entries.append(self._entry(module, suffix, info))
        if unknown:
            logger.warning("Ignoring GGUF tensors vx's model has no place for: %s.", ", ".join(unknown))
        self._kept_mappings: list[mmap.mmap] = []

    def _entry(self, module: str, suffix: str, info: TensorInfo) -> _Entry:
        """The tensor's entry, once it is checked to be one vx loads."""
        where = f"GGUF tensor {info.name!r} in {self.path!r}"
        if info.ggml_type not in SUPPORTED_TYPES:
            raise ValueError(f"{where} has type {type_name(info.ggml_type)}, which vx cannot load; vx loads "
                             f"{', '.join(type_name(t) for t in SUPPORTED_TYPES)}.")
        if len(info.dims) == 1:
            if info.ggml_type not in FLOAT_TYPES:
                raise ValueError(f"{where} is 1-D of type {type_name(info.ggml_type)}; vx expects 1-D tensors "
                                 "(norms, biases) in a float type.")
            shape: tuple[int, ...] = (row_bytes(info.ggml_type, info.dims[0]),)
        elif len(info.dims) == 2 and suffix == "weight":
            shape = (info.dims[1], row_bytes(info.ggml_type, info.dims[0]))
        else:
            raise ValueError(f"{where} has shape {info.dims}; vx expects 2-D weights and 1-D norms and biases.")
        return _Entry(module, suffix, info.name, info.ggml_type, info.offset, shape)

    def _map(self, entry: _Entry) -> tuple[np.ndarray, mmap.mmap]:
        """The tensor's bytes through a private mapping of their own (copy-on-write: a writable buffer for torch;
        the file is never written)."""
        start = entry.offset - entry.offset % mmap.ALLOCATIONGRANULARITY
        size = int(np.prod(entry.shape))
        with open(self.path, "rb") as f:
            mapping = mmap.mmap(f.fileno(), entry.offset + size - start, offset=start, access=mmap.ACCESS_COPY)
        data = np.frombuffer(mapping, dtype=np.uint8, count=size, offset=entry.offset - start).reshape(entry.shape)
        return data, mapping

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for entry in self.entries:
            data, mapping = self._map(entry)
            if entry.module in _KEPT_TABLES:
                self._kept_mappings.append(mapping)
            if self.architecture in _PERMUTED_ARCHITECTURES and entry.module.endswith((".q_proj", ".k_proj")):
                # Weights and biases alike: the permutation is of the output features.
                heads = self.num_heads if entry.module.endswith(".q_proj") else self.num_kv_heads
                rows = entry.shape[0] if len(entry.shape) == 2 else entry.shape[0] // _element_size(entry.ggml_type)
                data = unpermute_rows(data.reshape(rows, -1), heads).reshape(entry.shape)
            if len(entry.shape) == 1:  # a norm or a bias: float, under its own name
                tensor = torch.from_numpy(data).view(FLOAT_TYPES[entry.ggml_type])
                if self.architecture in _NORMS_PLUS_ONE and entry.module.endswith("norm"):
                    tensor = tensor.float() - 1.0
                yield f"{entry.module}.{entry.suffix}", tensor
            else:
                yield f"{entry.module}.qweight_type", torch.tensor(entry.ggml_type)
                yield f"{entry.module}.qweight", torch.from_numpy(data)

    def close(self) -> None:
        """Loading is over: drop the pages repacking read from the kept tables' mappings (never written, so a later
        lookup reads its rows back from the file); every other mapping went with the views of it."""
        for mapping in self._kept_mappings:
            mapping.madvise(mmap.MADV_DONTNEED)
        self._kept_mappings.clear()


def _element_size(ggml_type: int) -> int:
    return FLOAT_TYPES[ggml_type].itemsize
