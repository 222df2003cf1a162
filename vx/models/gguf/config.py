"""Write a GGUF file's model directory, once: config.json, generation_config.json and the tokenizer (with its chat
template), read from the file's metadata by transformers. No weights: config.json's `quantization_config`
({"quant_method": "gguf", "gguf_file": path}) points the engine at the file, which it loads quantized
(vx/models/gguf/weights.py).

transformers' GGUF config mapping leaves out fields some families need; they are read from the metadata here as
llama.cpp's converter writes them, as each architecture's row in vx.models.registry says (data, or one of the
functions below that the row names): Gemma 2's soft caps and query scale, Phi-3's partial rotary, LongRoPE factors
(stored as tensors) and window, Qwen3-MoE's expert width, and Mixtral, which llama.cpp writes as arch "llama" with
an expert count and transformers reads as a plain Llama. DeepSeek-V2 (`deepseek2`), which transformers does not map
at all, has its whole config read by vx.models.gguf.deepseek2.

Run as `python -m vx.models.gguf.config SRC.gguf DST_DIR`: the front end starts it in a child process, so the
application's process never imports torch (transformers does).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, NamedTuple

from vx.class_path import load_name
from vx.config.checkpoint_files import checked_gguf_header
from vx.models.gguf.header import TensorInfo, read_gguf_header
from vx.models.registry import gguf_architecture


def write_gguf_config(src: str, dst: str) -> None:
    """Write config.json (pointing at `src`), generation_config.json and the tokenizer files into `dst`."""
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    # The header within vx's limits and its shape within range first (the parent checked the file whole, but this
    # module also runs on its own): the readers below materialize every metadata value and build per-layer lists.
    header, _, _ = checked_gguf_header(src)
    arch = header.architecture
    quirks = gguf_architecture(arch)
    src = os.path.realpath(src)
    folder, name = os.path.split(src)
    os.makedirs(dst, exist_ok=True)
    if quirks.whole_config is not None:
        # transformers maps no config of this architecture (nor, through it, AutoTokenizer): the config is read by
        # the row's function and the tokenizer by the class that converts a GGUF vocabulary whatever the architecture.
        config = load_name(quirks.whole_config)(src)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
    else:
        config = family_config(src, arch, AutoConfig.from_pretrained(folder, gguf_file=name))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    cfg = config.to_dict()
    cfg["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    cfg["quantization_config"] = {"quant_method": "gguf", "gguf_file": src,
                                  "row_parallel_block": row_parallel_block(header.tensors)}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    gen = {"eos_token_id": cfg.get("eos_token_id"), "bos_token_id": cfg.get("bos_token_id")}
    if tokenizer.eos_token_id is not None:
        gen["eos_token_id"] = tokenizer.eos_token_id
    with open(os.path.join(dst, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    tokenizer.save_pretrained(dst)


_ROW_PARALLEL_TENSORS = (".attn_output.weight", ".ffn_down.weight")


def row_parallel_block(tensors: list[TensorInfo]) -> int:
    """The largest block, in weights along a row, of the tensors that tensor parallelism splits along their rows
    (o_proj, down_proj; experts are dequantized at load): what each rank's share of a row must be a multiple of,
    so that the config can check a split before any worker reads the file (vx.models.layers.quantization.tp_split)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    blocks = [GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)][0] for t in tensors
              if t.name.endswith(_ROW_PARALLEL_TENSORS) and t.ggml_type in GGML_QUANT_SIZES]
    return max(blocks, default=1)


class GGUFFile(NamedTuple):
    """What a quirk reads of a file: its path, architecture, metadata and tensors by name."""

    path: str
    arch: str
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]

    def meta(self, key: str, default: Any = None) -> Any:
        """The metadata value `<arch>.<key>`, or `default`."""
        return self.metadata.get(f"{self.arch}.{key}", default)


def family_config(path: str, arch: str, config: Any) -> Any:
    """`config` (transformers' reading of the file) with the family fields its mapping leaves out, read from the
    file's metadata and tensors as llama.cpp's converter writes them (the quirks of `arch`'s registry row)."""
    quirks = gguf_architecture(arch)
    header = read_gguf_header(path, f"{arch}.")  # the header alone: the vocabulary is not parsed again
    file = GGUFFile(path, arch, header.metadata, {t.name: t for t in header.tensors})
    cfg = config.to_dict()
    if quirks.wide_query_scale_layers is not None:
        # The file has no query scale (transformers' default is 256): llama.cpp scales by the head size, but by
        # hidden / heads for the model of the row's layer count (Gemma's 27B), as its query_pre_attn_scalar says.
        layers, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
        wide = layers == quirks.wide_query_scale_layers
        cfg["query_pre_attn_scalar"] = hidden // heads if wide else cfg["head_dim"]
    for field, key in quirks.metadata_fields:
        cfg[field] = file.meta(key, cfg.get(field))
    for field in quirks.dropped_fields:
        cfg.pop(field, None)  # re-derived for the file's shape (Gemma 2's layer_types: llama.cpp's even layers slide)
    if quirks.wide_query_scale_layers is not None or quirks.metadata_fields or quirks.dropped_fields:
        config = _rebuilt(config, cfg)
    if quirks.config_fields is not None:
        config = load_name(quirks.config_fields)(config, file)
    return config


def _rebuilt(config: Any, cfg: dict[str, Any]) -> Any:
    """A config of `config`'s class from the edited fields `cfg`."""
    cfg.pop("model_type", None)
    return type(config).from_dict(cfg)


def phi3_rope(config: Any, file: GGUFFile) -> Any:
    """Phi-3's partial rotary, LongRoPE factors (stored as tensors) and window, which transformers' mapping leaves
    out."""
    cfg = config.to_dict()
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    rotary = file.meta("rope.dimension_count", head_dim)
    original = file.meta("rope.scaling.original_context_length", cfg["max_position_embeddings"])
    window = file.meta("attention.sliding_window", 0)
    cfg["sliding_window"] = window or None  # llama.cpp's converter writes 0 for "none" (Phi-4)
    cfg["original_max_position_embeddings"] = original
    rope = {"rope_type": "default", "rope_theta": cfg.get("rope_theta") or
            (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)}
    long, short = file.tensors.get("rope_factors_long.weight"), file.tensors.get("rope_factors_short.weight")
    if (long is None) != (short is None):
        raise ValueError(f"{file.path!r} has one of LongRoPE's factor tensors (rope_factors_long / _short) only.")
    if long is not None and short is not None:
        rope.update(rope_type="longrope", long_factor=_floats(file.path, long),
                    short_factor=_floats(file.path, short), original_max_position_embeddings=original)
    if rotary != head_dim:
        rope["partial_rotary_factor"] = cfg["partial_rotary_factor"] = rotary / head_dim
    cfg["rope_parameters"] = rope
    cfg.pop("rope_scaling", None)
    cfg.pop("rope_theta", None)
    return _rebuilt(config, cfg)


def qwen3moe_experts(config: Any, file: GGUFFile) -> Any:
    """Qwen3-MoE's expert width and routing as llama.cpp runs it, which transformers' mapping leaves out."""
    cfg = config.to_dict()
    # The experts' width; a file without the key still states it in its expert tensors' rows.
    gate = file.tensors.get("blk.0.ffn_gate_exps.weight")
    width = file.meta("expert_feed_forward_length", None if gate is None else int(gate.dims[1]))
    if width is None:
        raise ValueError(f"{file.path!r} states no expert width ({file.arch}.expert_feed_forward_length) and has no "
                         "ffn_gate_exps tensor.")
    cfg["moe_intermediate_size"] = int(width)
    cfg["norm_topk_prob"] = bool(file.meta("expert_weights_norm", True))  # llama.cpp's qwen3moe renormalises
    cfg["mlp_only_layers"], cfg["decoder_sparse_step"] = [], 1  # llama.cpp's qwen3moe: every layer sparse
    return _rebuilt(config, cfg)


def experts_as_mixtral(config: Any, file: GGUFFile) -> Any:
    """A Llama-architecture file with an expert count is Mixtral (llama.cpp writes it so; transformers reads it as a
    plain Llama); any other is the Llama config as read."""
    if not file.meta("expert_count", 0):
        return config
    return _mixtral_config(config.to_dict(), int(file.meta("expert_count")), int(file.meta("expert_used_count")))


def _floats(path: str, tensor: TensorInfo) -> list[float]:
    """A small F32 tensor's values (Phi-3's LongRoPE factors)."""
    import numpy as np

    if tensor.ggml_type != 0 or len(tensor.dims) != 1:  # 0: GGML's F32
        raise ValueError(f"GGUF tensor {tensor.name!r} in {path!r}: expected 1-D F32 values.")
    return np.fromfile(path, dtype="<f4", count=tensor.dims[0], offset=tensor.offset).tolist()


def _mixtral_config(llama: dict[str, Any], experts: int, used: int) -> Any:
    """A Mixtral config from the Llama one transformers read (llama.cpp writes Mixtral as arch "llama"; its
    experts' width is the file's feed-forward length, and it has no sliding window)."""
    from transformers import MixtralConfig

    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
            "rope_theta", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "dtype")
    fields = {k: llama[k] for k in keep if llama.get(k) is not None}
    return MixtralConfig(**fields, num_local_experts=experts, num_experts_per_tok=used, sliding_window=None)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m vx.models.gguf.config SRC.gguf DST_DIR", file=sys.stderr)
        return 2
    try:
        write_gguf_config(args[0], args[1])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
