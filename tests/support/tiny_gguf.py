"""Tiny seeded Llama models written as GGUF files with the gguf package's writer, each with its reference: the same
weights dequantized by `gguf.quants.dequantize`, saved as a float32 Hugging Face directory for vx's float path.

What a llama.cpp converter does is done here independently of vx: Hugging Face names to GGUF names by the gguf
package's map (HF -> GGUF, the direction converters use), q and k rows permuted for llama.cpp's rotary layout, the
tokenizer stored as a "gpt2" (byte-level BPE) vocabulary with merges. The K-quants need rows of 256, so the model's
widths are multiples of 256.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from gguf import (GGML_QUANT_SIZES, MODEL_ARCH, GGMLQuantizationType, GGUFWriter, TokenType, get_tensor_name_map,
                  quants)

from tests.support.gguf_quants import quantize
from tests.support.tiny_models import make_tiny_hf_model
from tests.support.tiny_tokenizer import CHATML_TEMPLATE, SPECIAL_TOKENS, make_tiny_tokenizer

T = GGMLQuantizationType

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, attention_bias=False, max_position_embeddings=1024,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
"""The tiny model: every input width a multiple of 256, GQA (4 query heads, 2 KV heads of 64)."""

QUANTIZABLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
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
# norm weight stored as 1 + the checkpoint's (Gemma keeps them as offsets from 1). The query scale is 256 ** -0.5,
# which transformers reads from a Gemma 3 file whatever its head size (real checkpoints: the head size).
GEMMA3_SHAPE = dict(num_hidden_layers=6, head_dim=64, query_pre_attn_scalar=256, sliding_window=16, layer_types=None,
                    final_logit_softcapping=None,
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})


def write_tiny_gguf(dirpath: str | os.PathLike, types: TypeChooser, tied: bool = False, seed: int = 0,
                    tokenizer_dir: str | None = None, family: str = "llama", **overrides: object) -> TinyGGUF:
    """Write `model.gguf` (weights stored as `types` says) and `float/` (the same weights as gguf dequantizes
    them) in `dirpath`. `tokenizer_dir`: a tiny tokenizer made before, to share (else one is made here).
    `family`: "llama" or "gemma3"."""
    dirpath = os.fspath(dirpath)
    os.makedirs(dirpath, exist_ok=True)
    if tokenizer_dir is None:
        tokenizer_dir = os.path.join(dirpath, "tokenizer")
        make_tiny_tokenizer(tokenizer_dir)
    with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    gemma = family == "gemma3"
    shape = {**SHAPE, **GEMMA3_SHAPE, "tie_word_embeddings": True} if gemma else {**SHAPE, "tie_word_embeddings": tied}
    tied = shape["tie_word_embeddings"]
    hf = make_tiny_hf_model(family, seed=seed, **{**shape, "vocab_size": len(vocab), "bos_token_id": 0,
                                                  "eos_token_id": 0, "pad_token_id": 0, **overrides})
    config = hf.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads

    gguf_path = os.path.join(dirpath, "model.gguf")
    writer = GGUFWriter(gguf_path, family)
    writer.add_name(f"tiny-{seed}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if gemma:
        writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(config.sliding_window)
    else:
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
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

    names = get_tensor_name_map(MODEL_ARCH.GEMMA3 if gemma else MODEL_ARCH.LLAMA, config.num_hidden_layers)
    reference: dict[str, torch.Tensor] = {}
    for name, param in hf.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        module, suffix = name.rsplit(".", 1)
        gguf_name = f"{names.get_name(module)}.{suffix}"
        data = param.detach().float().numpy()
        heads_here = None if gemma else heads if ".q_proj." in name else kv_heads if ".k_proj." in name else None
        if heads_here is not None:
            data = permute_rows(data, heads_here)
        offset = 1.0 if gemma and name.endswith("norm.weight") else 0.0
        data = data + offset
        qtype = T.F32 if data.ndim == 1 else T(types(name))
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
            stored = np.random.default_rng(seed).integers(0, 256, (data.shape[0], data.shape[1] // block * size),
                                                          dtype=np.uint8)
            with np.errstate(invalid="ignore", over="ignore"):  # random f16 scales may be NaN: never computed with
                back = quants.dequantize(stored, qtype)
        else:
            stored = quantize(data, qtype)
            back = quants.dequantize(stored, qtype)
        writer.add_tensor(gguf_name, stored, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
        if heads_here is not None:
            back = inverse_permute_rows(back, heads_here)
        back = back - offset
        reference[name] = torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    float_dir = os.path.join(dirpath, "float")
    _save_float_dir(hf, reference, float_dir, tokenizer_dir)
    return TinyGGUF(gguf_path, float_dir, tokenizer_dir, len(vocab))


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
