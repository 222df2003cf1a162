"""Whether a quantized model's weights split over tensor-parallel ranks: which formats split, and the alignment
each asks of a rank's slice, checked from the config before any worker starts.

A column-parallel layer (q|k|v, gate|up) splits its output features, a row-parallel one (o_proj, down_proj) its
input features K. A format that stores K in blocks or groups (GGUF blocks of 32 or 256 weights, AWQ/GPTQ groups)
can give each rank whole blocks only when K / tp is a multiple of the block; a format that packs output features
into words (AWQ: 8 a word, GPTQ's zeros: 32 / bits) needs each rank's output features to fill whole words. A model
that cannot be split so is a `ValueError` naming the layer and the sizes.

Pure arithmetic on the config (no torch): it runs in the application's process. Which methods split, why the others
do not, and the alignment each asks are their rows' (vx.models.layers.quantization.registry); this module applies
them to the model's layer sizes.
"""

from __future__ import annotations

from typing import Any

from vx.models.layers.quantization.registry import METHODS, find_quantization_method

SPLIT_METHODS: tuple[str, ...] = tuple(m.name for m in METHODS if m.splits)
"""The quantization methods whose weights split over tensor-parallel ranks."""


def _get(hf_config: Any, name: str, default: Any = None) -> Any:
    return hf_config.get(name, default) if isinstance(hf_config, dict) else getattr(hf_config, name, default)


def _quant_config(hf_config: Any) -> dict[str, Any]:
    qc = _get(hf_config, "quantization_config")
    if qc is None:
        return {}
    return dict(qc) if isinstance(qc, dict) else dict(qc.to_dict())


def _layer_sizes(hf_config: Any, tp: int, head_dim: int, kv_heads: int,
                 ) -> tuple[dict[str, int], dict[str, list[int]]]:
    """(row-parallel layer -> its input features K, column-parallel layer -> its parts' output features per rank;
    with more ranks than KV heads each rank holds one replicated KV head)."""
    heads = int(_get(hf_config, "num_attention_heads"))
    inter = _get(hf_config, "intermediate_size")
    kv_per_rank = (kv_heads // tp if kv_heads >= tp else 1) * head_dim
    rows = {"self_attn.o_proj": heads * head_dim}
    columns = {"self_attn.qkv_proj": [heads * head_dim // tp, kv_per_rank, kv_per_rank]}
    if inter and _has_dense_mlp(hf_config):
        rows["mlp.down_proj"] = int(inter)
        columns["mlp.gate_up_proj"] = [int(inter) // tp, int(inter) // tp]
    return rows, columns


def _has_dense_mlp(hf_config: Any) -> bool:
    """Whether some layer has a dense MLP (gate|up, down of intermediate_size): not a Mixtral, nor a Qwen3-MoE whose
    every layer is sparse (their experts are float in every quantized format vx splits: GGUF's are dequantized)."""
    if _get(hf_config, "num_local_experts"):
        return False
    if _get(hf_config, "num_experts"):
        return bool(_get(hf_config, "mlp_only_layers")) or int(_get(hf_config, "decoder_sparse_step", 1) or 1) > 1
    return True


def check_quantized_split(method: str | None, hf_config: Any, tp: int, head_dim: int, kv_heads: int) -> None:
    """`ValueError` unless the quantized model `method` splits over `tp` tensor-parallel ranks (module docstring)."""
    if tp == 1 or method is None:
        return
    row = find_quantization_method(method)
    if row is None or not row.splits:
        reason = row.not_split_reason if row is not None else "this format is not split across ranks"
        raise ValueError(f"tensor_parallel_size={tp}: quantized weights ({method}) are not split across "
                         f"tensor-parallel ranks ({reason}); these are: {', '.join(SPLIT_METHODS)}. Use "
                         "tensor_parallel_size=1 (pipeline_parallel_size may be > 1).")
    alignment = row.alignment(_quant_config(hf_config))
    if alignment.refusal is not None:
        raise ValueError(f"tensor_parallel_size={tp}: {alignment.refusal}")
    align, what, pack = alignment.multiple, alignment.what, alignment.pack
    rows, columns = _layer_sizes(hf_config, tp, head_dim, kv_heads)
    for layer, k in rows.items():
        if (k // tp) % align:
            raise ValueError(f"tensor_parallel_size={tp}: {layer} has {k} input features, {k // tp} per rank, which "
                             f"is not a multiple of the {what}; each rank must hold whole {alignment.whole}. Use a "
                             f"tensor_parallel_size that leaves a multiple of {align} per rank.")
    for layer, parts in columns.items():
        if pack > 1 and any(size % pack for size in parts):
            raise ValueError(f"tensor_parallel_size={tp}: {layer}'s output features per rank {parts} are not all "
                             f"multiples of the {pack} that {method.upper()} packs a word.")
