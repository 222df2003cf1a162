"""Whether a quantized model's weights split over tensor-parallel ranks: which formats split, and the alignment
each asks of a rank's slice, checked from the config before any worker starts.

A column-parallel layer (q|k|v, gate|up) splits its output features, a row-parallel one (o_proj, down_proj) its
input features K. A format that stores K in blocks or groups (GGUF blocks of 32 or 256 weights, AWQ/GPTQ groups)
can give each rank whole blocks only when K / tp is a multiple of the block; a format that packs output features
into words (AWQ: 8 a word, GPTQ's zeros: 32 / bits) needs each rank's output features to fill whole words. A model
that cannot be split so is a `ValueError` naming the layer and the sizes.

Pure arithmetic on the config (no torch): it runs in the application's process. A GGUF file's block along the
rows of its row-parallel tensors (32 for Q4_0..Q8_0, 256 for the K-quants) is written into its config directory's
`quantization_config` as `row_parallel_block` (vx.models.gguf.config); a config directory written before that holds it is
checked against GGUF's smallest block (32), and a K-quant tensor a rank would cut mid-block is then refused by the
layer as it loads, by name.
"""

from __future__ import annotations

from typing import Any

SPLIT_METHODS: tuple[str, ...] = ("gguf", "awq", "gptq", "fp8")
"""The quantization methods whose weights split over tensor-parallel ranks."""

_NOT_SPLIT_REASONS = {
    "int8": "its per-row scales would be taken over each rank's half of a row, a different model than TP=1",
    "int4": "quantizing at load is not split across ranks yet",
}

GGUF_MIN_BLOCK = 32
"""The smallest block of GGUF's quantized types (Q4_0..Q8_0); the K-quants' super-blocks hold 256."""

_INT4_KERNEL_GROUP = 32  # the 4-bit kernel takes groups that are multiples of 32 (packing.py)


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


def _alignment(method: str, qc: dict[str, Any]) -> tuple[int, str, int]:
    """(what K / tp must be a multiple of, what that is called, how many output features a word packs)."""
    if method == "gguf":
        block = int(qc.get("row_parallel_block", GGUF_MIN_BLOCK))
        return block, f"GGUF file's block of {block} weights (of its o_proj/down_proj tensors' types)", 1
    if method == "awq":
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        if group == -1:
            return _INT4_KERNEL_GROUP, f"{_INT4_KERNEL_GROUP}-feature group of the 4-bit kernel", 8
        return group, f"AWQ group_size of {group}", 8
    if method == "gptq":
        bits = int(qc.get("bits", 4))
        group = int(qc.get("group_size", 128))
        pack = 32 // bits
        if group == -1:
            align = _INT4_KERNEL_GROUP if bits == 4 else pack
            return align, f"{align}-feature unit of GPTQ {bits}-bit (one group per row)", pack
        return group, f"GPTQ group_size of {group}", pack
    return 1, "", 1  # fp8: a scale per tensor or per output row, nothing to align


def check_quantized_split(method: str | None, hf_config: Any, tp: int, head_dim: int, kv_heads: int) -> None:
    """`ValueError` unless the quantized model `method` splits over `tp` tensor-parallel ranks (module docstring)."""
    if tp == 1 or method is None:
        return
    if method not in SPLIT_METHODS:
        reason = _NOT_SPLIT_REASONS.get(method, "this format is not split across ranks")
        raise ValueError(f"tensor_parallel_size={tp}: quantized weights ({method}) are not split across "
                         f"tensor-parallel ranks ({reason}); these are: {', '.join(SPLIT_METHODS)}. Use "
                         "tensor_parallel_size=1 (pipeline_parallel_size may be > 1).")
    qc = _quant_config(hf_config)
    if method == "gptq" and qc.get("desc_act") and int(qc.get("group_size", 128)) != -1:
        raise ValueError(f"tensor_parallel_size={tp}: a GPTQ checkpoint with desc_act (activation order) puts a "
                         "rank's input features in any group; vx splits GPTQ only without desc_act.")
    align, what, pack = _alignment(method, qc)
    rows, columns = _layer_sizes(hf_config, tp, head_dim, kv_heads)
    for layer, k in rows.items():
        if (k // tp) % align:
            raise ValueError(f"tensor_parallel_size={tp}: {layer} has {k} input features, {k // tp} per rank, which "
                             f"is not a multiple of the {what}; each rank must hold whole "
                             f"{'blocks' if method == 'gguf' else 'groups'}. Use a "
                             f"tensor_parallel_size that leaves a multiple of {align} per rank.")
    for layer, parts in columns.items():
        if pack > 1 and any(size % pack for size in parts):
            raise ValueError(f"tensor_parallel_size={tp}: {layer}'s output features per rank {parts} are not all "
                             f"multiples of the {pack} that {method.upper()} packs a word.")
