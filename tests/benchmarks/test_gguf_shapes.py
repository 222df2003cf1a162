"""benchmarks.gguf_shapes: real-shape files in llama.cpp's Q4_K_M mix, with valid random blocks and the default
model's tokenizer."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from benchmarks.gguf_shapes import SHAPES, random_gguf, tensor_plan
from vx.config.model_source import default_model_file
from vx.models.gguf.header import read_gguf_header

T = GGMLQuantizationType


def test_q4_k_m_mix_of_the_1_7b_shape():
    types = {name: T(t) for name, _, t in tensor_plan(SHAPES["1.7b"])}
    assert types["token_embd.weight"] == T.Q6_K and "output.weight" not in types  # tied: the embedding is the head
    wide = {i for i in range(24) if types[f"blk.{i}.attn_v.weight"] == T.Q6_K}
    assert wide == {0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23}  # the first and last eighth, every third between
    assert wide == {i for i in range(24) if types[f"blk.{i}.ffn_down.weight"] == T.Q6_K}
    others = Counter(t for name, t in types.items() if not name.endswith(("attn_v.weight", "ffn_down.weight",
                                                                          "token_embd.weight")))
    assert others == {T.Q4_K: 24 * 5, T.F32: 24 * 2 + 1}


def test_untied_8b_shape_has_a_q6_k_head_and_a_q4_k_embedding():
    types = {name: T(t) for name, _, t in tensor_plan(SHAPES["8b"])}
    assert types["token_embd.weight"] == T.Q4_K and types["output.weight"] == T.Q6_K


@pytest.mark.slow
def test_tiny_file_holds_the_plan_valid_blocks_and_the_default_tokenizer():
    path = random_gguf("tiny")
    assert random_gguf("tiny") == path  # cached: the same file, not rewritten
    header = read_gguf_header(path, key_prefix="llama.")
    shape = SHAPES["tiny"]
    plan = list(tensor_plan(shape))
    assert [(t.name, t.dims[::-1], t.ggml_type) for t in header.tensors] == plan
    assert header.metadata["llama.embedding_length"] == shape.hidden
    assert header.metadata["llama.attention.head_count_kv"] == shape.kv_heads
    default = read_gguf_header(default_model_file())
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        assert header.array_lengths[key] == default.array_lengths[key]
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    for t in header.tensors:
        if t.ggml_type in (T.Q4_K, T.Q6_K):
            rows = raw[t.offset:t.offset + t.nbytes].reshape(t.dims[1], -1)
            weights = quants.dequantize(np.asarray(rows[:64]), T(t.ggml_type))
            assert np.isfinite(weights).all() and 0.001 < weights.std() < 0.05  # as small as trained weights
    assert os.path.getsize(path) > sum(t.nbytes for t in header.tensors)
