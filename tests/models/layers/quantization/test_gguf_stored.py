"""GGUF weights kept as stored (gguf_stored.py): which layers take the as-stored kernel, that a tied table looks its
rows up exactly, that a traced graph reaches the kernel through its operator, and that a model's logits stay within
the int8 rounding's reach of the float path's.

Bound for the logits: both int8 paths round x, the repacked one per group of 32, the as-stored one per block of 256
(Q4_K, Q5_K, Q6_K) or 32 (the other types); a coarser block has a larger step (max |x| over more values), so the
as-stored path's distance from the float logits is allowed 2x the repacked int8 path's (measured 1.0-1.25x on these
models). The tiny
models' peaked logits (|logit| ~15) move by 1-4 under either int8 path, more than their top-two gaps, so greedy
tokens are not compared here; a wrong block or scale moves them by the logits' own size.
The kernels' own bound against gguf's dequantization is checked per type in tests/kernels/test_gguf_kquant.py.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from tests.models.layers.quantization.test_gguf import _load, _logits, _mapped_file
from vx.kernels.gguf_matmul import load_gguf_matmul_kernel
from vx.models.layers.quantization import gguf as gguf_method
from vx.models.layers.quantization import gguf_stored
from vx.models.layers.quantization.gguf_stored import StoredGGUFWeight
from vx.models.layers.quantization.kernels import Int4Groupwise, Int8Groupwise

T = GGMLQuantizationType


@pytest.fixture(autouse=True)
def int8_activations(monkeypatch):
    """The as-stored kernel serves int8 activations only (this package's conftest sets `float` for the others)."""
    kernel = load_gguf_matmul_kernel()
    if kernel is None or not kernel.types:
        pytest.skip("the GGUF matmul kernel does not build here")
    monkeypatch.setenv("VX_CPU_MATMUL", "int8")
    # The tiny models' weights are far below the size from which Q4_0/Q4_1/Q8_0 are kept as stored.
    monkeypatch.setattr(gguf_stored, "STORED_FROM_BYTES", 0)


def _repacked(monkeypatch):
    """Make the loader repack every type (the int8 path of kernels.py), as before the as-stored kernel."""
    monkeypatch.setattr(gguf_method, "stored_kernel_for", lambda ggml_type, device, nbytes=None: None)


def _distance(got: dict, want: dict) -> float:
    return max((got[k] - want[k]).abs().max().item() for k in want)


def test_a_q4_k_m_file_keeps_its_blocks_as_stored(tiny_gguf):
    tiny = tiny_gguf("Q4_K_M")
    model = _load(tiny, gguf=True)
    layer = model.model.layers[1]
    qkv = layer.self_attn.qkv_proj.__dict__["gguf_kernels"]  # q, k Q4_K; v Q6_K
    assert [(type(k), k.ggml_type, k.out_features) for k in qkv] == [(StoredGGUFWeight, T.Q4_K, 384),
                                                                      (StoredGGUFWeight, T.Q6_K, 128)]
    gate_up = layer.mlp.gate_up_proj.__dict__["gguf_kernels"]  # gate Q4_0, up Q4_K: two runs as stored
    assert [k.ggml_type for k in gate_up] == [T.Q4_0, T.Q4_K]
    down = layer.mlp.down_proj.__dict__["gguf_kernels"]
    assert [k.ggml_type for k in down] == [T.Q6_K]
    assert model.lm_head.__dict__["gguf_head"].ggml_type == T.Q6_K
    # The bytes kept are the file's: 144 per 256 weights of Q4_K, 210 of Q6_K; a layer of one shard keeps the
    # file's mapping itself (only fused shards are copied together).
    assert down[0].nbytes == 256 * 512 // 256 * 210
    assert _mapped_file(down[0].blocks.data_ptr()) == tiny.gguf_path


def test_float_activations_keep_the_repacked_path(tiny_gguf, monkeypatch):
    monkeypatch.setenv("VX_CPU_MATMUL", "float")
    model = _load(tiny_gguf("Q4_K_M"), gguf=True)
    qkv = model.model.layers[1].self_attn.qkv_proj.__dict__["gguf_kernels"]
    assert [type(k) for k in qkv] == [Int4Groupwise, Int8Groupwise]


@pytest.mark.parametrize("types,repacked", [("Q4_1", Int4Groupwise), ("Q5_0", Int8Groupwise),
                                            ("Q5_1", Int8Groupwise), ("IQ4_XS", Int8Groupwise)])
def test_every_quantized_type_keeps_its_blocks_under_int8_and_repacks_under_float(tiny_gguf, types, repacked,
                                                                                 monkeypatch):
    """The default model's Q4_1 among them: its layers read the file's blocks unless VX_CPU_MATMUL=float."""
    tiny = tiny_gguf(types)
    down = _load(tiny, gguf=True).model.layers[0].mlp.down_proj.__dict__["gguf_kernels"]
    assert [(type(k), k.ggml_type) for k in down] == [(StoredGGUFWeight, T[types])]
    monkeypatch.setenv("VX_CPU_MATMUL", "float")
    down = _load(tiny, gguf=True).model.layers[0].mlp.down_proj.__dict__["gguf_kernels"]
    assert [type(k) for k in down] == [repacked]


@pytest.mark.parametrize("types", ["Q4_1", "Q5_0"])
def test_small_weights_of_the_types_repacked_into_as_many_bits_are_repacked(tiny_gguf, types, monkeypatch):
    """Q4_1 (as Q4_0 and Q8_0) saves no bytes as stored: a weight below `STORED_FROM_BYTES` is repacked, where the
    repacked kernel costs less per call; Q5_0 (9 bits a weight repacked, 5.5 as stored) is kept as stored anyway."""
    tiny = tiny_gguf(types)
    down = _load(tiny, gguf=True).model.layers[0].mlp.down_proj.__dict__["gguf_kernels"][0]
    monkeypatch.setattr(gguf_stored, "STORED_FROM_BYTES", down.nbytes + 1)
    again = _load(tiny, gguf=True).model.layers[0].mlp.down_proj.__dict__["gguf_kernels"][0]
    assert isinstance(again, Int4Groupwise if types == "Q4_1" else StoredGGUFWeight)


@pytest.mark.parametrize("types", ["Q4_K_M", "Q4_K", "Q6_K", "Q8_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_XS"])
def test_logits_within_the_int8_rounding_of_the_float_path(tiny_gguf, types, monkeypatch):
    tiny = tiny_gguf(types)
    stored = _logits(_load(tiny, gguf=True))
    want = _logits(_load(tiny, gguf=False))
    _repacked(monkeypatch)
    repacked = _logits(_load(tiny, gguf=True))
    d_stored, d_repacked = _distance(stored, want), _distance(repacked, want)
    assert d_stored <= 2 * d_repacked, (d_stored, d_repacked)


def test_a_tied_head_looks_rows_up_in_the_stored_blocks(tiny_gguf):
    tiny = tiny_gguf("Q8_0", tied=True)
    model = _load(tiny, gguf=True)
    embed = model.model.embed_tokens
    head = embed.__dict__["gguf_head"]
    assert isinstance(head, StoredGGUFWeight) and "gguf_rows" not in embed.__dict__
    ids = torch.tensor([5, 0, 5, tiny.vocab_size - 1])
    assert torch.equal(embed(ids), _load(tiny, gguf=False).model.embed_tokens(ids))


def test_a_traced_graph_calls_the_operator(tiny_gguf):
    """torch.compile reaches the kernel through `vx::gguf_matmul` (its Meta impl traces it) with the eager result."""
    model = _load(tiny_gguf("Q4_K_M"), gguf=True)
    weight = model.model.layers[0].mlp.down_proj.__dict__["gguf_kernels"][0]
    x = torch.randn(3, weight.in_features)
    compiled = torch.compile(weight.matmul, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), weight.matmul(x))
