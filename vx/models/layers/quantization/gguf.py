"""GGUF weights kept quantized: each linear layer, the token embedding and the LM head take a GGUF tensor's raw
blocks as the file holds them and either keep them as they are for the as-stored kernel (gguf_stored.py: on the
CPU with int8 activations, for the types it serves) or repack them once into the kernels of kernels.py.

A tensor's type is known only when it arrives (a Q4_K_M file mixes Q4_K and Q6_K, even within one fused qkv or
gate_up layer), so a layer's parameters are placeholders: its loaders keep what arrives, per fused shard, and
`process_weights_after_loading` cuts this rank's part and repacks it. Q4_0, Q4_1 and Q4_K become `Int4Groupwise`
(groups of 32); Q8_0, Q5_0, Q5_1, Q5_K and IQ4_XS `Int8Groupwise` (groups of 32), Q6_K `Int8Groupwise` (groups of
16); F32/F16/BF16 a float weight in the model dtype. Consecutive shards that land on the same kernel share one; a
fused layer whose shards differ keeps one kernel per run of shards and concatenates their outputs. The as-stored
kernel takes every quantized type vx loads; the float ones take the float weight either way.
"""

from __future__ import annotations

from typing import Any, Iterable, Union

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from vx.models.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                     RowParallelLinear)
from vx.models.layers.quantization.base_config import (EmbeddingMethodBase, LinearMethodBase, QuantizationConfig,
                                                       set_weight_attrs)
from vx.models.layers.quantization.gguf_blocks import (FLOAT_TYPES, SUPPORTED_TYPES, GroupwiseInts, as_float,
                                                       row_bytes, type_name, unpack)
from vx.models.layers.quantization.gguf_stored import RawBlocks, StoredGGUFWeight, stored_kernel_for
from vx.models.layers.quantization.kernels import Int4Groupwise, Int8Groupwise
from vx.models.layers.vocab_embedding import ParallelLMHead

ShardId = Union[str, int, None]


class FloatWeight:
    """A float weight [N, K] behind the kernels' interface (GGUF's F32/F16/BF16 tensors)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def matmul(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [..., K] @ W^T -> [..., N], in `out_dtype` (default x's)."""
        return F.linear(x, self.weight).to(out_dtype or x.dtype)


Kernel = Union[Int4Groupwise, Int8Groupwise, FloatWeight, StoredGGUFWeight]
Part = Union[GroupwiseInts, torch.Tensor, RawBlocks]


class GGUFConfig(QuantizationConfig):
    """A model whose weights are a GGUF file's tensors: `quantization_config` {"quant_method": "gguf",
    "gguf_file": path}, written by vx when it reads the file's config (vx.config.model_source)."""

    name = "gguf"

    def __init__(self, gguf_file: str) -> None:
        self.gguf_file = gguf_file
        self.dtype = torch.float32  # the model's, once `verify` has seen it (what dequantized experts cost)

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> "GGUFConfig":
        path = quant_config.get("gguf_file")
        if not isinstance(path, str) or not path:
            raise ValueError("A GGUF model's quantization_config must name its file ('gguf_file'); pass the .gguf "
                             "file itself as model= and vx writes it.")
        return cls(path)

    def verify(self, device: torch.device, dtype: torch.dtype) -> None:
        """Every device and dtype runs; the dtype is kept to size what dequantizing experts costs."""
        self.dtype = dtype

    def get_linear_method(self, layer: nn.Module, prefix: str) -> "GGUFLinearMethod":
        return GGUFLinearMethod(prefix)

    def get_embedding_method(self, layer: nn.Module, prefix: str) -> "GGUFEmbeddingMethod":
        return GGUFEmbeddingMethod(prefix)

    def weights(self, model_path: str, hf_config: Any) -> Iterable[tuple[str, torch.Tensor]]:
        from vx.models.gguf.weights import GGUFWeights

        return GGUFWeights(self.gguf_file, hf_config, self.dtype)


class _Received:
    """What arrived for one layer before it is readied: raw blocks (views of the file) and types, per shard."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.blocks: dict[ShardId, torch.Tensor] = {}
        self.types: dict[ShardId, int] = {}

    def take(self, shard_id: ShardId) -> tuple[torch.Tensor, int]:
        where = self.name if shard_id is None else f"{self.name} [{shard_id}]"
        if shard_id not in self.blocks or shard_id not in self.types:
            raise ValueError(f"{where}: the GGUF file gave no tensor (or no type) for it.")
        raw, ggml_type = self.blocks.pop(shard_id), self.types.pop(shard_id)
        if ggml_type not in SUPPORTED_TYPES:
            raise ValueError(f"{where}: GGUF type {type_name(ggml_type)} is not supported.")
        if raw.dtype != torch.uint8 or raw.dim() != 2:
            raise ValueError(f"{where}: expected raw rows of bytes, got {raw.dtype} {tuple(raw.shape)}.")
        return raw, ggml_type


def _register_placeholders(layer: nn.Module, name: str) -> None:
    """`qweight` (raw blocks) and `qweight_type` (the ggml type): empty parameters whose loaders keep what arrives
    aside, in `layer.gguf_received`, until the layer is readied."""
    received = _Received(name)

    def load_blocks(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        received.blocks[shard_id] = loaded  # a view of the file: nothing is copied before the layer is readied

    def load_type(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        received.types[shard_id] = int(loaded)

    for param_name, loader in (("qweight", load_blocks), ("qweight_type", load_type)):
        param = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        set_weight_attrs(param, {"weight_loader": loader})
        layer.register_parameter(param_name, param)
    layer.__dict__["gguf_received"] = received


def _shard_plan(layer: nn.Module) -> list[tuple[ShardId, int, int, int]]:
    """(shard id, rows this rank holds, rows of the file's tensor, which chunk of those rows is this rank's), in the
    order of the layer's output features."""
    tp, rank = layer.tp_size, layer.tp_rank
    if isinstance(layer, QKVParallelLinear):
        kv_full = layer.total_num_kv_heads * layer.head_size
        kv_rank = rank // layer.num_kv_head_replicas
        return [("q", layer.q_size, layer.q_size * tp, rank), ("k", layer.kv_size, kv_full, kv_rank),
                ("v", layer.kv_size, kv_full, kv_rank)]
    if isinstance(layer, MergedColumnParallelLinear):
        return [(i, size // tp, size, rank) for i, size in enumerate(layer.output_sizes)]
    if isinstance(layer, ColumnParallelLinear):
        n = layer.output_size_per_partition
        return [(None, n, n * tp, rank)]
    return [(None, layer.output_size_per_partition, layer.output_size_per_partition, 0)]


def _rank_part(layer: nn.Module, raw: torch.Tensor, ggml_type: int, rows: int, full_rows: int, chunk: int,
               where: str) -> torch.Tensor:
    """This rank's rows (and, for a row-parallel layer, input features) of a file tensor; whole blocks cut exactly."""
    full_bytes = row_bytes(ggml_type, layer.input_size)
    if tuple(raw.shape) != (full_rows, full_bytes):
        raise ValueError(f"{where}: the GGUF tensor ({type_name(ggml_type)}, {raw.shape[0]} rows of {raw.shape[1]} "
                         f"bytes) does not match the model's {full_rows} x {layer.input_size} weights.")
    raw = raw.narrow(0, chunk * rows, rows)
    if isinstance(layer, RowParallelLinear) and layer.tp_size > 1:
        block = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)][0]
        if layer.input_size_per_partition % block:
            raise ValueError(f"{where}: tensor_parallel_size={layer.tp_size} gives each rank "
                             f"{layer.input_size_per_partition} of its {layer.input_size} input features, which is "
                             f"not a multiple of {type_name(ggml_type)}'s block of {block} weights; a rank must hold "
                             f"whole blocks (use a tensor_parallel_size that leaves a multiple of {block}).")
        width = row_bytes(ggml_type, layer.input_size_per_partition)
        raw = raw.narrow(1, layer.tp_rank * width, width)
    return raw


def _run_key(part: Part) -> tuple:
    """Which kernel a part lands on: parts with the same key share one."""
    if isinstance(part, RawBlocks):
        return ("stored", part.ggml_type)
    return ("float",) if isinstance(part, torch.Tensor) else (part.bits, part.group_size)


def make_kernel(parts: list[Part], dtype: torch.dtype, device: torch.device) -> Kernel:
    """One kernel for shards of one kind, stacked along the output features; scales and zeros in `dtype`."""
    if isinstance(parts[0], RawBlocks):
        rows = parts[0].rows if len(parts) == 1 else torch.cat([p.rows for p in parts])
        return StoredGGUFWeight(rows.to(device), parts[0].ggml_type, stored_kernel_for(parts[0].ggml_type, device))
    if isinstance(parts[0], torch.Tensor):
        return FloatWeight(torch.cat(parts).to(device=device, dtype=dtype))
    q = torch.cat([p.q for p in parts]).to(device)
    scale = torch.cat([p.scale for p in parts]).to(device=device, dtype=dtype)
    zero = torch.cat([p.zero for p in parts]).to(device=device, dtype=dtype)
    kernel_cls = Int4Groupwise if parts[0].bits == 4 else Int8Groupwise
    return kernel_cls(q, scale, zero, parts[0].group_size)


def _unpacked(raw: torch.Tensor, ggml_type: int, device: torch.device) -> Part:
    """The raw rows themselves where the as-stored kernel takes them on `device`, else integers for a quantized
    type, the float rows (float32) for a float one."""
    if stored_kernel_for(ggml_type, device, raw.nbytes) is not None:
        return RawBlocks(raw, ggml_type)
    return as_float(raw, ggml_type).float() if ggml_type in FLOAT_TYPES else unpack(raw, ggml_type)


class GGUFLinearMethod(LinearMethodBase):
    """A linear layer from GGUF tensors: raw blocks in, one kernel per run of same-kind shards out."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self.params_dtype = torch.float32

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        self.params_dtype = params_dtype
        _register_placeholders(layer, self.prefix or type(layer).__name__)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        received: _Received = layer.__dict__.pop("gguf_received")
        device = layer.qweight.device
        kernels: list[Kernel] = []
        run: list[Part] = []
        for shard_id, rows, full_rows, chunk in _shard_plan(layer):
            raw, ggml_type = received.take(shard_id)
            where = received.name if shard_id is None else f"{received.name} [{shard_id}]"
            part = _unpacked(_rank_part(layer, raw, ggml_type, rows, full_rows, chunk, where), ggml_type, device)
            if run and _run_key(run[0]) != _run_key(part):
                kernels.append(make_kernel(run, self.params_dtype, device))
                run = []
            run.append(part)
        kernels.append(make_kernel(run, self.params_dtype, device))
        layer.__dict__["gguf_kernels"] = kernels

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        kernels: list[Kernel] = layer.__dict__["gguf_kernels"]
        y = kernels[0].matmul(x) if len(kernels) == 1 else torch.cat([k.matmul(x) for k in kernels], dim=-1)
        return y if bias is None else y + bias


class GGUFEmbeddingMethod(EmbeddingMethodBase):
    """A token embedding or LM head from a GGUF tensor. An embedding keeps the raw rows and dequantizes only the
    rows a batch gathers; a table that computes logits (an LM head, or an embedding a head is tied to) gets a
    kernel for the matmul. A float table serves both as it is."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self.params_dtype = torch.float32

    def create_weights(self, layer: nn.Module, num_embeddings_per_partition: int, embedding_dim: int,
                       params_dtype: torch.dtype) -> None:
        self.params_dtype = params_dtype
        _register_placeholders(layer, self.prefix or type(layer).__name__)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        received: _Received = layer.__dict__.pop("gguf_received")
        raw, ggml_type = received.take(None)
        full_bytes = row_bytes(ggml_type, layer.embedding_dim)
        if tuple(raw.shape) != (layer.num_embeddings, full_bytes):
            raise ValueError(f"{received.name}: the GGUF tensor ({type_name(ggml_type)}, {raw.shape[0]} rows of "
                             f"{raw.shape[1]} bytes) does not match the model's {layer.num_embeddings} x "
                             f"{layer.embedding_dim} table.")
        device = layer.qweight.device
        # This rank's vocabulary rows, padded with zero rows (which read as zero weights in every type).
        rows = raw[layer.vocab_start:layer.vocab_end]
        pad = layer.num_embeddings_per_partition - rows.shape[0]
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
        if ggml_type in FLOAT_TYPES:
            layer.__dict__["gguf_table"] = as_float(rows, ggml_type).to(device=device, dtype=self.params_dtype)
            return
        head = None
        if layer.serves_lm_head:
            head = make_kernel([_unpacked(rows, ggml_type, device)], self.params_dtype, device)
        if head is not None:
            layer.__dict__["gguf_head"] = head
        if isinstance(layer, ParallelLMHead) or getattr(head, "can_dequantize_rows", False):
            # A table tied to its head looks its rows up in the head's packed weight: no second copy of the table,
            # and no pages of the file mapped in as lookups touch them (a long run would map all of them: the
            # default model's 29 MiB).
            return
        # It looks rows up: kept as given (on the CPU the GGUF source maps the table on its own, and only the rows
        # batches look up become resident, with the pages around them).
        layer.__dict__["gguf_rows"] = rows.to(device)
        layer.__dict__["gguf_type"] = ggml_type

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        table = layer.__dict__.get("gguf_table")
        if table is not None:
            return F.embedding(input_ids, table)
        rows = layer.__dict__.get("gguf_rows")
        if rows is None:
            out = layer.__dict__["gguf_head"].dequantize_rows(input_ids.reshape(-1))
        else:
            out = unpack(rows[input_ids.reshape(-1)], layer.__dict__["gguf_type"]).dequantize()
        return out.to(self.params_dtype).reshape(*input_ids.shape, -1)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        table = layer.__dict__.get("gguf_table")
        # Logits leave the head in float32 (ParallelLMHead's contract): asked of the kernel, not rounded to x's dtype
        # and back.
        y = F.linear(x, table) if table is not None else layer.__dict__["gguf_head"].matmul(x, torch.float32)
        return y if bias is None else y + bias
