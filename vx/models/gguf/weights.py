"""A GGUF file's tensors under the Hugging Face names vx's models load, straight from the file.

Each tensor is memory-mapped where the file's header (vx/models/gguf/header.py) says it lies and handed out as a
view: nothing is copied or dequantized here. A weight (2-D) arrives as its raw rows of bytes, `<module>.qweight`,
after its ggml type, `<module>.qweight_type`, for the layer's GGUF method to repack; a norm or bias (1-D, always
float in GGUF) arrives as a float tensor under its own name. The names come from the gguf package's map (HF module
-> GGUF tensor), reversed. llama.cpp stores a llama-architecture file's q and k rows permuted for its rotary layout;
the rows are put back in Hugging Face's order here, which moves whole rows of blocks and so is exact for every type.
Phi-3's fused qkv and gate|up tensors are cut into their projections the same way, by whole rows.

Mixture-of-experts files (qwen3moe, and Mixtral as arch "llama" with experts) stack each layer's experts in one
tensor per projection, [E, rows, features]. vx's `FusedMoE` has no quantized kernels, so these arrive expert by
expert as float weights: float types as they are, quantized ones dequantized by the gguf package as they load
(any type it dequantizes, K-quants and i-quants included); the file's other weights stay quantized. Files converted
before llama.cpp stacked experts (early Mixtral ones) hold one tensor per expert, `blk.N.ffn_gate.E`; those load the
same way.

DeepSeek-V2 files (arch deepseek2) load their MLA projections, dense and shared-expert MLPs quantized too, but
kv_b_proj arrives as a float weight, dequantized: the MLA backend reads it per head (the absorbed decode folds it into
the query and the output), which the quantized kernels cannot give. Older converters store it as one attn_kv_b
tensor; newer ones split it per head into attn_k_b (transposed: [heads, kv_lora_rank, nope]) and attn_v_b ([heads, v,
kv_lora_rank]), which are put back together here. The router (ffn_gate_inp) is a float32 parameter in vx's DeepSeek-V2,
as Hugging Face keeps it, so it too arrives dequantized if the file quantized it.

Each tensor has a mapping of its own, let go with the last view of it (once its layer is readied). The token
embedding is read a few rows per step for as long as the model runs, so the model keeps its view: `close()` (when
loading ends) drops the pages repacking read from it, and afterwards only the rows batches look up are resident.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch

from vx.config import hf_num_kv_heads
from vx.models.gguf.header import TensorInfo, read_gguf_header
from vx.models.layers.quantization.gguf_blocks import FLOAT_TYPES, SUPPORTED_TYPES, row_bytes, type_name
from vx.models.registry import GGUFArchitecture, gguf_architecture

logger = logging.getLogger(__name__)

_FUSED_MODULES = ("self_attn.qkv_proj", "mlp.gate_up_proj")

# A layer's stacked experts ([E, rows, features] per projection) and their HF projection names.
_EXPERT_MODULES = ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")
# One expert's projection as early converters wrote them: blk.N.ffn_gate.E.
_SINGLE_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)$")

# The Hugging Face modules of a Llama-family checkpoint, as the safetensors path names them.
_MODEL_MODULES = ("model.embed_tokens", "model.norm", "lm_head")
# Tables the model keeps as they arrive, read a few rows at a time (the token embedding's lookups).
_KEPT_TABLES = ("model.embed_tokens",)
_LAYER_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                  "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm", "mlp.gate", *_EXPERT_MODULES)
_SPLIT_KV_B = (".self_attn.k_b_proj", ".self_attn.v_b_proj")


def gguf_to_hf_names(architecture: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor base name ("blk.0.attn_q") -> Hugging Face module ("model.layers.0.self_attn.q_proj")."""
    import gguf

    arch = next((key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise ValueError(f"The gguf package does not know the architecture {architecture!r}.")
    name_map = gguf.get_tensor_name_map(arch, num_layers)
    quirks = gguf_architecture(architecture)
    layer_modules = (*_LAYER_MODULES, *(_FUSED_MODULES if quirks.fused_projections else ()), *quirks.extra_modules)
    modules = [*_MODEL_MODULES, *(f"model.layers.{i}.{m}" for i in range(num_layers) for m in layer_modules)]
    names: dict[str, str] = {}
    for module in modules:
        gguf_name = name_map.get_name(module)
        if gguf_name is not None:
            names[gguf_name] = module  # a fused module comes last and takes its name (Phi-3's ffn_up is gate|up)
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
    shape: tuple[int, ...]  # in bytes: (rows, bytes per row), (experts, rows, bytes per row), or (bytes,)


class GGUFWeights:
    """The tensors of one GGUF file as (Hugging Face name, tensor) pairs for `load_weights`.

    Opening checks the whole file against what vx loads (architecture, every tensor's type), so an unsupported
    file fails before the model is built. Each tensor is mapped on its own, so a layer's part of the file is let go
    once the layer is readied.
    """

    def __init__(self, path: str, hf_config: Any, dtype: torch.dtype = torch.float32) -> None:
        if not os.path.isfile(path):
            raise ValueError(f"GGUF file {path!r} does not exist (the model's config.json points at it).")
        header = read_gguf_header(path)
        self.architecture = header.architecture
        self.quirks: GGUFArchitecture = gguf_architecture(self.architecture)
        self.path = path
        self.num_heads = int(hf_config.num_attention_heads)
        self.num_kv_heads = hf_num_kv_heads(hf_config)
        self.fused_sizes = _fused_sizes(hf_config) if self.quirks.fused_projections else {}
        names = gguf_to_hf_names(self.architecture, int(hf_config.num_hidden_layers))
        self.entries: list[_Entry] = []
        unknown = []
        for info in header.tensors:
            base, _, suffix = info.name.rpartition(".")
            module = names.get(base)
            if base in self.quirks.config_tensors:  # read into the config (vx.models.gguf.config), not weights
                continue
            single = _SINGLE_EXPERT.match(base)
            if single is not None:
                layer, projection, expert = single.groups()
                module = f"model.layers.{layer}.mlp.experts.{expert}.{projection}_proj"
            if module is None or suffix not in ("weight", "bias"):
                unknown.append(info.name)
                continue
            self.entries.append(self._entry(module, suffix, info))
        if unknown:
            logger.warning("Ignoring GGUF tensors vx's model has no place for: %s.", ", ".join(unknown))
        self.entries = self._one_kv_b_form(self.entries)
        self._kept_mappings: list[mmap.mmap] = []
        self._split_kv_b: dict[str, dict[str, torch.Tensor]] = {}
        _log_dequantized([e for e in self.entries if ".experts." in e.module], dtype, "expert",
                         "float expert stacks", "vx's fused MoE has no quantized kernels yet")
        _log_dequantized([e for e in self.entries if self._is_float(e.module)], dtype, "MLA up-projection and "
                         "router", "float weights", "the MLA backend reads kv_b_proj per head; the router is float32")

    def _is_float(self, module: str) -> bool:
        """Whether the model runs this (non-expert) module's weight in float: dequantized as it loads."""
        return module.endswith(self.quirks.float_modules)

    def _one_kv_b_form(self, entries: list[_Entry]) -> list[_Entry]:
        """Each layer's kv_b_proj from attn_kv_b where the file has it, else from its attn_k_b and attn_v_b
        (which must come in pairs)."""
        layers = {e.module.rpartition(".")[0] for e in entries if e.module.endswith(".self_attn.kv_b_proj")}
        halves: dict[str, set[str]] = {}
        kept = []
        for e in entries:
            layer, _, name = e.module.rpartition(".")
            if e.module.endswith(_SPLIT_KV_B):
                if layer in layers:
                    continue  # both forms stored: the whole tensor is the one read
                halves.setdefault(layer, set()).add(name)
            kept.append(e)
        for layer, names in halves.items():
            if len(names) != 2:
                raise ValueError(f"GGUF file {self.path!r} has {', '.join(sorted(names))} but not both k_b_proj and "
                                 f"v_b_proj (attn_k_b, attn_v_b) for {layer}.kv_b_proj.")
        return kept

    def _entry(self, module: str, suffix: str, info: TensorInfo) -> _Entry:
        """The tensor's entry, once it is checked to be one vx loads."""
        where = f"GGUF tensor {info.name!r} in {self.path!r}"
        if ".experts." in module or self._is_float(module):
            return self._dequantized_entry(module, suffix, info, where)
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

    def _dequantized_entry(self, module: str, suffix: str, info: TensorInfo, where: str) -> _Entry:
        """A weight the model runs in float: a layer's stacked experts (3-D), one expert's projection (2-D), a float
        module's weight (2-D; DeepSeek-V2's split k_b / v_b 3-D, per head); in a float type or one the gguf package
        dequantizes."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

        stacked = module.endswith(_EXPERT_MODULES + _SPLIT_KV_B)
        if len(info.dims) != (3 if stacked else 2) or suffix != "weight":
            raise ValueError(f"{where} has shape {info.dims}; vx expects " + (
                "a 3-D weight [experts or heads, rows, features]." if stacked else "a 2-D weight [rows, features]."))
        try:
            qtype = GGMLQuantizationType(info.ggml_type)
            block, size = GGML_QUANT_SIZES[qtype]
            if info.ggml_type not in FLOAT_TYPES:  # fails now, not halfway through loading, for a type it lacks
                quants.dequantize(np.zeros((1, size), dtype=np.uint8), qtype)
        except (ValueError, KeyError, NotImplementedError) as e:
            raise ValueError(f"{where} has type {type_name(info.ggml_type)}, which the gguf package cannot "
                             f"dequantize for the float weights vx runs it in: {e}") from e
        if info.dims[0] % block:
            raise ValueError(f"{where}: rows of {info.dims[0]} features are not whole {qtype.name} blocks.")
        return _Entry(module, suffix, info.name, info.ggml_type, info.offset,
                      (*info.dims[:0:-1], info.dims[0] // block * size))

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
            if self.quirks.permuted_qk and entry.module.endswith((".q_proj", ".k_proj")):
                # Weights and biases alike: the permutation is of the output features.
                heads = self.num_heads if entry.module.endswith(".q_proj") else self.num_kv_heads
                rows = entry.shape[0] if len(entry.shape) == 2 else entry.shape[0] // _element_size(entry.ggml_type)
                data = unpermute_rows(data.reshape(rows, -1), heads).reshape(entry.shape)
            if ".experts." in entry.module:
                yield from _experts(entry, data)
            elif entry.module.endswith(_SPLIT_KV_B):
                yield from self._joined_kv_b(entry, data)
            elif self._is_float(entry.module):
                yield f"{entry.module}.weight", _as_float(entry, data)
            elif entry.module.endswith(_FUSED_MODULES):
                yield from self._unfused(entry, data)
            elif len(entry.shape) == 1:  # a norm or a bias: float, under its own name
                tensor = torch.from_numpy(data).view(FLOAT_TYPES[entry.ggml_type])
                if self.quirks.norms_plus_one and entry.module.endswith("norm"):
                    tensor = tensor.float() - 1.0
                yield f"{entry.module}.{entry.suffix}", tensor
            else:
                yield f"{entry.module}.qweight_type", torch.tensor(entry.ggml_type)
                yield f"{entry.module}.qweight", torch.from_numpy(data)

    def _unfused(self, entry: _Entry, data: np.ndarray) -> Iterator[tuple[str, torch.Tensor]]:
        """A fused qkv or gate|up tensor as its projections, cut by whole rows (exact for every type)."""
        sizes = self.fused_sizes[entry.module.rpartition(".")[2]]
        rows = data.shape[0] if data.ndim == 2 else data.shape[0] // _element_size(entry.ggml_type)
        if rows != sum(size for _, size in sizes):
            raise ValueError(f"GGUF tensor {entry.name!r}: {rows} rows, expected "
                             f"{' + '.join(str(size) for _, size in sizes)} ({', '.join(n for n, _ in sizes)}).")
        prefix = entry.module.rpartition(".")[0]
        start = 0
        for name, size in sizes:
            if data.ndim == 1:
                part = torch.from_numpy(data).view(FLOAT_TYPES[entry.ggml_type])[start:start + size]
                yield f"{prefix}.{name}.{entry.suffix}", part
            else:
                yield f"{prefix}.{name}.qweight_type", torch.tensor(entry.ggml_type)
                yield f"{prefix}.{name}.qweight", torch.from_numpy(data[start:start + size])
            start += size

    def _joined_kv_b(self, entry: _Entry, data: np.ndarray) -> Iterator[tuple[str, torch.Tensor]]:
        """kv_b_proj's weight [heads * (nope + v), kv_lora_rank], once both of a layer's halves have arrived:
        per head, k_b [kv_lora_rank, nope] transposed back, then v_b [v, kv_lora_rank]."""
        attn, _, half = entry.module.rpartition(".")
        got = self._split_kv_b.setdefault(attn, {})
        got[half] = _as_float(entry, data)
        if len(got) < 2:
            return
        del self._split_kv_b[attn]
        k_b, v_b = got["k_b_proj"], got["v_b_proj"]
        if k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
            raise ValueError(f"GGUF tensors of {attn}: k_b_proj {tuple(k_b.shape)} and v_b_proj {tuple(v_b.shape)} "
                             "are not [heads, kv_lora_rank, nope] and [heads, v, kv_lora_rank].")
        joined = torch.cat((k_b.transpose(1, 2), v_b), dim=1)
        yield f"{attn}.kv_b_proj.weight", joined.reshape(-1, joined.shape[-1])

    def close(self) -> None:
        """Loading is over: drop the pages repacking read from the kept tables' mappings (never written, so a later
        lookup reads its rows back from the file); every other mapping went with the views of it."""
        for mapping in self._kept_mappings:
            mapping.madvise(mmap.MADV_DONTNEED)
        self._kept_mappings.clear()


def _element_size(ggml_type: int) -> int:
    return FLOAT_TYPES[ggml_type].itemsize


def _fused_sizes(hf_config: Any) -> dict[str, list[tuple[str, int]]]:
    """The projections a fused tensor's rows hold, in order: q, k, v and gate, up."""
    from vx.config import hf_head_dim

    head_dim = hf_head_dim(hf_config)
    q, kv = int(hf_config.num_attention_heads) * head_dim, hf_num_kv_heads(hf_config) * head_dim
    inter = int(hf_config.intermediate_size)
    return {"qkv_proj": [("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
            "gate_up_proj": [("gate_proj", inter), ("up_proj", inter)]}


def _experts(entry: _Entry, data: np.ndarray) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked expert tensor as one float weight per expert, under the names `MoECausalLM` stacks
    ("model.layers.N.mlp.experts.E.gate_proj.weight"): float types as views, quantized ones dequantized one
    expert at a time (so only one expert's float copy exists beside the stack)."""
    if data.ndim == 2:  # one expert's projection, named as such already
        yield f"{entry.module}.weight", _as_float(entry, data)
        return
    layer, _, projection = entry.module.rpartition(".experts.")
    for expert in range(data.shape[0]):
        yield f"{layer}.experts.{expert}.{projection}.weight", _as_float(entry, data[expert])


def _as_float(entry: _Entry, rows: np.ndarray) -> torch.Tensor:
    """Rows of an entry's bytes as float weights: float types as views, quantized ones dequantized by gguf."""
    from gguf import GGMLQuantizationType, quants

    if entry.ggml_type in FLOAT_TYPES:
        return torch.from_numpy(rows).view(FLOAT_TYPES[entry.ggml_type])
    return torch.from_numpy(quants.dequantize(rows, GGMLQuantizationType(entry.ggml_type)))


def _log_dequantized(entries: list[_Entry], dtype: torch.dtype, what: str, into: str, why: str) -> None:
    """One line for the model: what dequantizing these quantized tensors costs in float memory."""
    quantized = [e for e in entries if e.ggml_type not in FLOAT_TYPES]
    if not quantized:
        return
    file_bytes = sum(int(np.prod(e.shape)) for e in quantized)
    weights = sum(int(np.prod(e.shape[:-1])) * _features(e) for e in quantized)
    types = sorted({type_name(e.ggml_type) for e in quantized})
    logger.info("Dequantizing %d quantized GGUF %s tensors (%s, %.1f MiB in the file) into %s: %.1f MiB in %s (%s).",
                len(quantized), what, ", ".join(types), file_bytes / 2**20, into, weights * dtype.itemsize / 2**20,
                str(dtype).removeprefix("torch."), why)


def _features(entry: _Entry) -> int:
    """The features in one row of a dequantized tensor."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(entry.ggml_type)]
    return entry.shape[-1] // size * block
