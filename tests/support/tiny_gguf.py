"""Tiny seeded Llama models written as GGUF files with the gguf package's writer, each with its reference: the same
weights dequantized by `gguf.quants.dequantize`, saved as a float32 Hugging Face directory for vx's float path.

What a llama.cpp converter does is done here independently of vx: Hugging Face names to GGUF names by the gguf
package's map (HF -> GGUF, the direction converters use), q and k rows permuted for llama.cpp's rotary layout, the
tokenizer stored as a "gpt2" (byte-level BPE) vocabulary with merges. The K-quants need rows of 256, so the Llama and
Gemma 3 models' widths are multiples of 256; the other families (Gemma 2, Phi-3, Qwen3-MoE, Mixtral) keep the tiny
shapes of tests/support/tiny_models.py, whose widths are multiples of 32 (the blocks of Q4_0..Q8_0).

Per family, as llama.cpp's converter writes them: Gemma norms stored as 1 + the checkpoint's; Phi-3's q|k|v and
gate|up fused (attn_qkv, ffn_up), its partial rotary as the rotary dimension count and its LongRoPE factors as two
float tensors; experts stacked per layer and projection (ffn_gate_exps / ffn_up_exps / ffn_down_exps [E, ...]) with
the router as ffn_gate_inp; Mixtral as arch "llama" with an expert count; DeepSeek-V2 as arch "deepseek2" (q/k rows
not permuted: its rotary pairs are llama.cpp's), with MLA's ranks and lengths, the routing and YaRN in its keys and
kv_b_proj either whole (older converters) or split per head into attn_k_b (transposed) and attn_v_b (newer ones).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from gguf import (GGML_QUANT_SIZES, MODEL_ARCH, ExpertGatingFuncType, GGMLQuantizationType, GGUFWriter, RopeScalingType,
                  TokenType, get_tensor_name_map, quants)

from tests.support.gguf_quants import quantize
from tests.support.tiny_models import make_tiny_hf_model
from tests.support.tiny_tokenizer import CHATML_TEMPLATE, SPECIAL_TOKENS, make_tiny_tokenizer

T = GGMLQuantizationType

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, attention_bias=False, max_position_embeddings=1024,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
"""The tiny model: every input width a multiple of 256, GQA (4 query heads, 2 KV heads of 64)."""

QUANTIZABLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS)
"""The types tests.support.gguf_quants quantizes into."""

TypeChooser = Callable[[str], int]
"""Hugging Face tensor name -> the GGML type it is stored in (norms always stay F32)."""


@dataclass
class TinyGGUF:
    """A written GGUF file and the float directory holding the weights it stores."""

    gguf_path: str
    float_dir: str
    tokenizer_dir: str
    vocab_size: int


def permute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's permutation of q/k rows for its rotary layout (per head: halves interleaved)."""
    return rows.reshape(num_heads, 2, rows.shape[0] // num_heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(
        rows.shape)


def inverse_permute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """The inverse of `permute_rows`, written as its own transpose."""
    return rows.reshape(num_heads, rows.shape[0] // num_heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(
        rows.shape)


# Gemma 3 as llama.cpp's converter writes it: the default layer pattern (5 sliding, then 1 global; transformers
# reads the same default back, a GGUF file does not store it), q/k rows not permuted (neox rotary), and every
# norm weight stored as 1 + the checkpoint's (Gemma keeps them as offsets from 1). The query scale is the head
# size's, as llama.cpp takes it for every Gemma but the 27B (the file does not store it).
GEMMA3_SHAPE = dict(num_hidden_layers=6, head_dim=64, query_pre_attn_scalar=64, sliding_window=16, layer_types=None,
                    final_logit_softcapping=None,
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})


# The GGUF architecture each test family is written as, and the tiny_models overrides its file can express.
_ARCHES = {"llama": "llama", "gemma3": "gemma3", "gemma2": "gemma2", "phi3": "phi3", "qwen3_moe": "qwen3moe",
           "mixtral": "llama", "deepseek_v2": "deepseek2", "deepseek_v2_qlora_yarn": "deepseek2"}
_TINY_FAMILY_SHAPES: dict[str, dict[str, object]] = {
    "gemma2": {},
    "phi3": {},
    # llama.cpp's qwen3moe has no dense layers; expert rows of 64 make whole Q8_0 blocks.
    "qwen3_moe": dict(mlp_only_layers=[], moe_intermediate_size=64),
    # llama.cpp's llama architecture has no sliding window.
    "mixtral": dict(sliding_window=None),
    "deepseek_v2": {},
    # A q low rank of 32 (tiny_models' 24) so that q_b_proj's rows are whole Q8_0 blocks.
    "deepseek_v2_qlora_yarn": dict(q_lora_rank=32),
}
_DEEPSEEK = ("deepseek_v2", "deepseek_v2_qlora_yarn")


def write_tiny_gguf(dirpath: str | os.PathLike, types: TypeChooser, tied: bool = False, seed: int = 0,
                    tokenizer_dir: str | None = None, family: str = "llama", kv_b_form: str = "kv_b",
                    **overrides: object) -> TinyGGUF:
    """Write `model.gguf` (weights stored as `types` says) and `float/` (the same weights as gguf dequantizes
    them) in `dirpath`. `tokenizer_dir`: a tiny tokenizer made before, to share (else one is made here).
    `family`: "llama", "gemma3", "gemma2", "phi3", "qwen3_moe", "mixtral", "deepseek_v2" or
    "deepseek_v2_qlora_yarn". `kv_b_form` (DeepSeek-V2): "kv_b" as older converters write MLA's up-projection (one
    attn_kv_b tensor, head counts and lengths of the expanded heads), "split" as newer ones do (attn_k_b transposed
    and attn_v_b per head, one KV head, lengths of the latent and the _mla keys)."""
    dirpath = os.fspath(dirpath)
    os.makedirs(dirpath, exist_ok=True)
    if tokenizer_dir is None:
        tokenizer_dir = os.path.join(dirpath, "tokenizer")
        make_tiny_tokenizer(tokenizer_dir)
    with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    arch = _ARCHES[family]
    gemma = family in ("gemma2", "gemma3")
    if family in _TINY_FAMILY_SHAPES:
        shape = dict(_TINY_FAMILY_SHAPES[family])
        if family in ("qwen3_moe", "mixtral", *_DEEPSEEK):
            shape["tie_word_embeddings"] = tied
    elif family == "gemma3":
        shape = {**SHAPE, **GEMMA3_SHAPE, "tie_word_embeddings": True}
    else:
        shape = {**SHAPE, "tie_word_embeddings": tied}
    hf = make_tiny_hf_model(family, seed=seed, **{**shape, "vocab_size": len(vocab), "bos_token_id": 0,
                                                  "eos_token_id": 0, "pad_token_id": 0, **overrides})
    config = hf.config
    tied = config.tie_word_embeddings
    deepseek = family in _DEEPSEEK
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if deepseek and kv_b_form == "split":
        kv_heads = 1  # newer converters write MLA as one KV head of the latent's width
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    permuted = arch == "llama"

    gguf_path = os.path.join(dirpath, "model.gguf")
    writer = GGUFWriter(gguf_path, arch)
    writer.add_name(f"tiny-{seed}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"] if family == "gemma3" else rope["rope_theta"])
    if family in ("gemma2", "gemma3", "qwen3_moe"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if gemma:
        writer.add_sliding_window(config.sliding_window)
    if family == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if family == "phi3":
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_sliding_window(config.sliding_window or 0)
    if family == "qwen3_moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if family == "mixtral":
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if deepseek:
        _deepseek2_metadata(writer, config, kv_b_form)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0)) if family == "phi3" else head_dim
    if deepseek:
        rotary = config.qk_rope_head_dim
    writer.add_rope_dimension_count(rotary)
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([TokenType.CONTROL if t in SPECIAL_TOKENS else TokenType.NORMAL for t, _ in vocab])
    merges = tok["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)

    names = get_tensor_name_map(MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    if family == "phi3":  # LongRoPE's factors: float tensors, read into the config
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    reference: dict[str, torch.Tensor] = {}
    for name, param in hf.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        data = param.detach().float().numpy()
        if name.endswith(".experts.gate_up_proj"):  # [E, 2I, H]: stored as gate and up stacks
            layer = name.removesuffix(".gate_up_proj")
            inter = data.shape[1] // 2
            backs = [_store(writer, f"{names.get_name(f'{layer}.{proj}')}.weight", part, T(types(name)), seed)
                     for proj, part in (("gate_proj", data[:, :inter]), ("up_proj", data[:, inter:]))]
            reference[name] = torch.from_numpy(np.ascontiguousarray(np.concatenate(backs, axis=1), np.float32))
            continue
        if deepseek and kv_b_form == "split" and name.endswith("kv_b_proj.weight"):
            reference[name] = _store_split_kv_b(writer, names, name, data, config, T(types(name)), seed)
            continue
        if name.endswith(".experts.down_proj"):  # [E, H, I]
            gguf_name = f"{names.get_name(name)}.weight"
        else:
            module, suffix = name.rsplit(".", 1)
            gguf_name = f"{names.get_name(module)}.{suffix}"
        heads_here = (heads if ".q_proj." in name else kv_heads if ".k_proj." in name else None) if permuted else None
        if heads_here is not None:
            data = permute_rows(data, heads_here)
        offset = 1.0 if gemma and name.endswith("norm.weight") else 0.0
        back = _store(writer, gguf_name, data + offset, T.F32 if data.ndim == 1 else T(types(name)), seed)
        if heads_here is not None:
            back = inverse_permute_rows(back, heads_here)
        reference[name] = torch.from_numpy(np.ascontiguousarray(back - offset, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    float_dir = os.path.join(dirpath, "float")
    _save_float_dir(hf, reference, float_dir, tokenizer_dir)
    return TinyGGUF(gguf_path, float_dir, tokenizer_dir, len(vocab))


def _deepseek2_metadata(writer: GGUFWriter, config: object, kv_b_form: str) -> None:
    """DeepSeek-V2's keys as llama.cpp's converter writes them: MLA's ranks and head lengths (of the expanded heads in
    older files; of the latent, with the heads' in the _mla keys, in newer ones), the experts and their routing, and
    YaRN's scaling with DeepSeek's mscale_all_dim as a log multiplier of 0.1 times it."""
    if config.q_lora_rank:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(config.kv_lora_rank)
    qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    if kv_b_form == "split":
        writer.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
        writer.add_value_length(config.kv_lora_rank)
        writer.add_key_length_mla(qk_head_dim)
        writer.add_value_length_mla(config.v_head_dim)
    else:
        writer.add_key_length(qk_head_dim)
        writer.add_value_length(config.v_head_dim)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_expert_weights_norm(bool(config.norm_topk_prob))
    writer.add_expert_gating_func(ExpertGatingFuncType.SOFTMAX)
    if config.topk_method == "group_limited_greedy":
        writer.add_expert_group_count(config.n_group)
        writer.add_expert_group_used_count(config.topk_group)
    rope = config.rope_parameters
    if rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _store_split_kv_b(writer: GGUFWriter, names: object, name: str, data: np.ndarray, config: object, qtype: T,
                      seed: int) -> np.ndarray:
    """kv_b_proj as newer converters write it: per head, k_b [heads, kv_lora_rank, nope] (transposed) and v_b
    [heads, v, kv_lora_rank]. k_b's rows are the heads' nope features: a type whose blocks they do not fill falls
    back to F16, as llama.cpp's quantizer does. Returns the kv_b_proj weight the stored tensors hold."""
    heads, nope, v = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    per_head = data.reshape(heads, nope + v, data.shape[-1])
    k_b = np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1))
    base = names.get_name(name.removesuffix(".weight"))
    k_type = qtype if qtype in (T.F32, T.F16) or nope % GGML_QUANT_SIZES[qtype][0] == 0 else T.F16
    k_back = _store(writer, f"{base.replace('attn_kv_b', 'attn_k_b')}.weight", k_b, k_type, seed)
    v_back = _store(writer, f"{base.replace('attn_kv_b', 'attn_v_b')}.weight", np.ascontiguousarray(per_head[:, nope:]),
                    qtype, seed)
    back = np.concatenate([k_back.transpose(0, 2, 1), v_back], axis=1).reshape(data.shape)
    return torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32))


def _store(writer: GGUFWriter, gguf_name: str, data: np.ndarray, qtype: T, seed: int) -> np.ndarray:
    """Add `data` (rows, or stacked experts [E, rows, features]) to the file in `qtype`; returns what gguf
    dequantizes the stored tensor to."""
    if qtype == T.F32:
        stored, back = data, data
    elif qtype == T.F16:
        stored = data.astype(np.float16)
        back = stored.astype(np.float32)
    elif qtype == T.BF16:
        stored = quants.quantize(data, qtype)
        back = quants.dequantize(stored, qtype)
    elif qtype not in QUANTIZABLE:  # a type vx refuses (nothing quantizes it here): random blocks of its size
        block, size = GGML_QUANT_SIZES[qtype]
        stored = np.random.default_rng(seed).integers(0, 256, (*data.shape[:-1], data.shape[-1] // block * size),
                                                      dtype=np.uint8)
        with np.errstate(invalid="ignore", over="ignore"):  # random f16 scales may be NaN: never computed with
            back = quants.dequantize(stored, qtype)
    else:
        rows = quantize(data.reshape(-1, data.shape[-1]), qtype)
        stored = rows.reshape(*data.shape[:-1], rows.shape[-1])
        back = quants.dequantize(stored, qtype)
    writer.add_tensor(gguf_name, stored, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
    return back


def _save_float_dir(hf: torch.nn.Module, reference: dict[str, torch.Tensor], float_dir: str,
                    tokenizer_dir: str) -> None:
    """The reference weights in the HF model and saved with its config and the tokenizer."""
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name in reference:
                param.copy_(reference[name])
    hf.save_pretrained(float_dir)
    for file in os.listdir(tokenizer_dir):
        with open(os.path.join(tokenizer_dir, file), "rb") as src, open(os.path.join(float_dir, file), "wb") as dst:
            dst.write(src.read())


def uniform(qtype: int) -> TypeChooser:
    """Every weight in `qtype`."""
    return lambda name: qtype


def q4_k_m_like(name: str) -> int:
    """Mixed as llama.cpp's Q4_K_M mixes: v and down in Q6_K, the rest Q4_K (so qkv is Q4_K, Q4_K, Q6_K), the
    output head in Q6_K; the token embedding in Q8_0 and gate in Q4_0, so fused layers mix kernels both ways."""
    if name.endswith(("v_proj.weight", "down_proj.weight", "lm_head.weight")):
        return T.Q6_K
    if name.endswith("gate_proj.weight"):
        return T.Q4_0
    if name == "model.embed_tokens.weight":
        return T.Q8_0
    return T.Q4_K
