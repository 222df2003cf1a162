"""The GGUF methods: a model loaded natively from a GGUF file computes what vx's float path computes on the same
weights dequantized by gguf, for every type vx loads; fused layers keep a kernel per run of same-kind shards; the
embedding looks rows up in the file, the LM head (its own or the tied table) multiplies through a kernel; the
layers cut this rank's rows and blocks for tensor parallelism."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from transformers import AutoConfig
from tests.support.gguf_quants import quantize
from tests.support.paged_attention import PagedRunner

from vx.gpu.attention import get_attn_backend
from vx.gpu.kv_cache import bind_kv_caches
from vx.models import DefaultModelLoader
from vx.models.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                     RowParallelLinear)
from vx.models.layers.quantization.gguf import FloatWeight, GGUFConfig, GGUFEmbeddingMethod, GGUFLinearMethod
from vx.models.layers.quantization.gguf_blocks import dequantize
from vx.models.layers.quantization.kernels import Int4Groupwise, Int8Groupwise
from vx.models.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

T = GGMLQuantizationType
QUANTIZED = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
# Both paths multiply the same weights (the repacking is exact: test_gguf_blocks checks it bit for bit); they differ
# only in summation order, float32 rounding. Measured: up to 1.5e-4 on logits of magnitude ~19 for the 4-bit kernel,
# 0 for the others. A wrong nibble, scale or row moves logits by 0.1 or more.
ATOL = 1e-3
NUM_BLOCKS, BLOCK_SIZE = 64, 4


def _load(tiny, gguf: bool, dtype=torch.float32):
    config = AutoConfig.from_pretrained(tiny.float_dir)
    quant = GGUFConfig(tiny.gguf_path) if gguf else None
    return DefaultModelLoader().load_model(tiny.float_dir, config, dtype, torch.device("cpu"), quant)


def _logits(model, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Logits of a batched prefill of four prompts, then two steps mixing decodes with a chunk."""
    backend = get_attn_backend("auto", "cpu")
    bind_kv_caches(model, backend, NUM_BLOCKS, BLOCK_SIZE, dtype, "cpu")
    runner = PagedRunner(model, backend, NUM_BLOCKS, BLOCK_SIZE)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 1, 30)]
    for i, p in enumerate(prompts):
        runner.add(str(i), p)
    out = {f"{k}@0": v for k, v in runner.step({"0": 5, "1": 17, "2": 1, "3": 12}).items()}
    for step in (1, 2):
        for rid in "012":
            runner.append(rid, step + 10)
        out.update({f"{k}@{step}": v for k, v in runner.step({"0": 1, "1": 1, "2": 1, "3": 9}).items()})
    return out


def _assert_close(got: dict, want: dict, atol: float = ATOL) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=atol, rtol=0, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("types", [*QUANTIZED, "F16", "BF16", "F32"])
def test_native_logits_match_the_float_path_on_the_dequantized_weights(tiny_gguf, types):
    tiny = tiny_gguf(types)  # untied: the head is stored in this type too
    native = _load(tiny, gguf=True)
    assert isinstance(native.model.layers[0].mlp.down_proj.quant_method, GGUFLinearMethod)
    _assert_close(_logits(native), _logits(_load(tiny, gguf=False)))


def test_a_mixed_file_keeps_one_kernel_per_run_of_same_kind_shards(tiny_gguf):
    tiny = tiny_gguf("Q4_K_M")
    model = _load(tiny, gguf=True)
    layer = model.model.layers[1]
    qkv = layer.self_attn.qkv_proj.__dict__["gguf_kernels"]  # q, k Q4_K; v Q6_K
    assert [type(k) for k in qkv] == [Int4Groupwise, Int8Groupwise]
    assert [(k.out_features, k.group_size) for k in qkv] == [(256 + 128, 32), (128, 16)]
    gate_up = layer.mlp.gate_up_proj.__dict__["gguf_kernels"]  # gate Q4_0, up Q4_K: one 4-bit kernel
    assert [type(k) for k in gate_up] == [Int4Groupwise] and gate_up[0].out_features == 1024
    assert [type(k) for k in layer.mlp.down_proj.__dict__["gguf_kernels"]] == [Int8Groupwise]  # Q6_K
    assert isinstance(model.lm_head.__dict__["gguf_head"], Int8Groupwise)  # Q6_K head
    assert "gguf_head" not in model.model.embed_tokens.__dict__  # untied: the embedding only looks rows up
    _assert_close(_logits(model), _logits(_load(tiny, gguf=False)))


@pytest.mark.parametrize("types", ["Q8_0", "Q4_K"])
def test_a_tied_head_multiplies_through_a_kernel_of_the_embeddings_table(tiny_gguf, types):
    tiny = tiny_gguf(types, tied=True)
    model = _load(tiny, gguf=True)
    embed = model.model.embed_tokens
    assert model.lm_head.quant_method is embed.quant_method and isinstance(embed.quant_method, GGUFEmbeddingMethod)
    head = embed.__dict__["gguf_head"]
    assert isinstance(head, Int4Groupwise if types == "Q4_K" else Int8Groupwise)
    reference = _load(tiny, gguf=False)
    _assert_close(_logits(model), _logits(reference))
    # Rows are looked up in the head's packed weight (vx's C kernel), else in the file's raw rows; either way
    # exactly the GGUF values.
    assert ("gguf_rows" in embed.__dict__) != head.can_dequantize_rows
    ids = torch.tensor([5, 0, 5, tiny.vocab_size - 1])
    assert torch.equal(embed(ids), reference.model.embed_tokens(ids))


def test_the_embedding_dequantizes_the_rows_it_looks_up_from_the_files_mapping(tiny_gguf):
    tiny = tiny_gguf("Q4_K_M")
    model = _load(tiny, gguf=True)
    reference = _load(tiny, gguf=False)
    ids = torch.tensor([5, 0, 5, tiny.vocab_size - 1])
    assert torch.equal(model.model.embed_tokens(ids), reference.model.embed_tokens(ids))
    rows = model.model.embed_tokens.__dict__["gguf_rows"]
    assert _mapped_file(rows.data_ptr()) == tiny.gguf_path  # not a copy: only the rows used become resident


def _mapped_file(address: int) -> str | None:
    """The file mapped at `address` in this process (Linux), or None for anonymous memory."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= address < end:
                return parts[5] if len(parts) > 5 else None
    return None


def test_bfloat16_runs_close_to_float32(tiny_gguf):
    """In bfloat16 the scales and zeros are rounded to bf16 where the float path rounds each weight; both land about
    as far from the float32 logits (bf16 activations dominate; figures in docs/quantization.md)."""
    tiny = tiny_gguf("Q4_K")
    want = _logits(_load(tiny, gguf=False))
    native = _logits(_load(tiny, gguf=True, dtype=torch.bfloat16), torch.bfloat16)
    float_bf16 = _logits(_load(tiny, gguf=False, dtype=torch.bfloat16), torch.bfloat16)
    err_native = max((native[k] - want[k]).abs().max().item() for k in want)
    err_float = max((float_bf16[k] - want[k]).abs().max().item() for k in want)
    assert err_native < 3 * err_float, (err_native, err_float)  # a wrong scale or dtype is off by 10 or more


def _raw(rows: int, features: int, qtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw blocks of random weights, and the weights gguf dequantizes from them."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.from_numpy(quantize(torch.randn(rows, features, generator=g).numpy(), qtype).view(np.uint8))
    return raw, dequantize(raw, qtype)


def _feed(layer, tensors: dict, shard_id=None) -> None:
    raw, qtype = tensors
    for name, value in (("qweight_type", torch.tensor(int(qtype))), ("qweight", raw)):
        param = getattr(layer, name)
        if shard_id is None:
            param.weight_loader(param, value)
        else:
            param.weight_loader(param, value, shard_id)


class _Config(GGUFConfig):
    def __init__(self) -> None:
        super().__init__("unused.gguf")


@pytest.mark.parametrize("tp_rank", [0, 1])
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K])
def test_each_rank_cuts_its_rows_and_whole_blocks(tp_rank, qtype):
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    raw, w = _raw(64, 512, qtype, 1)
    column = ColumnParallelLinear(512, 64, tp_size=2, tp_rank=tp_rank, quant_config=_Config())
    _feed(column, (raw, qtype))
    column.quant_method.process_weights_after_loading(column)
    torch.testing.assert_close(column(x), F.linear(x, w[tp_rank * 32:(tp_rank + 1) * 32]), atol=1e-3, rtol=0)

    row = RowParallelLinear(512, 64, tp_size=2, tp_rank=tp_rank, quant_config=_Config())
    _feed(row, (raw, qtype))
    row.quant_method.process_weights_after_loading(row)
    half = slice(tp_rank * 256, (tp_rank + 1) * 256)
    x_rank = x[:, half].contiguous()  # this rank's input features, as the column-parallel layer before hands them
    torch.testing.assert_close(row.quant_method.apply(row, x_rank), F.linear(x_rank, w[:, half]), atol=1e-3, rtol=0)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_fused_layers_place_each_shard_of_its_own_type(tp_rank):
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(2))
    q, k, v = _raw(128, 256, T.Q4_K, 3), _raw(64, 256, T.Q4_K, 4), _raw(64, 256, T.Q6_K, 5)
    qkv = QKVParallelLinear(256, 32, 4, 2, tp_size=2, tp_rank=tp_rank, quant_config=_Config())
    for shard_id, (raw, w) in zip("qkv", (q, k, v)):
        _feed(qkv, (raw, T.Q4_K if shard_id != "v" else T.Q6_K), shard_id)
    qkv.quant_method.process_weights_after_loading(qkv)
    rows = lambda w, n: w[tp_rank * n:(tp_rank + 1) * n]  # noqa: E731
    want = torch.cat([rows(q[1], 64), rows(k[1], 32), rows(v[1], 32)])
    torch.testing.assert_close(qkv(x), F.linear(x, want), atol=1e-3, rtol=0)

    gate, up = _raw(64, 256, T.Q8_0, 6), _raw(64, 256, T.F16, 7)
    merged = MergedColumnParallelLinear(256, [64, 64], tp_size=2, tp_rank=tp_rank, quant_config=_Config())
    _feed(merged, (gate[0], T.Q8_0), 0)
    _feed(merged, (up[0], T.F16), 1)
    merged.quant_method.process_weights_after_loading(merged)
    assert [type(k) for k in merged.__dict__["gguf_kernels"]] == [Int8Groupwise, FloatWeight]
    torch.testing.assert_close(merged(x), F.linear(x, torch.cat([rows(gate[1], 32), rows(up[1], 32)])),
                               atol=1e-3, rtol=0)


def test_a_tensor_that_does_not_fit_or_is_missing_is_refused_naming_the_layer():
    layer = ColumnParallelLinear(256, 64, quant_config=_Config(), prefix="model.layers.0.mlp.x")
    _feed(layer, _raw(32, 256, T.Q8_0, 8)[0:1] + (T.Q8_0,))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.x: the GGUF tensor \(Q8_0, 32 rows"):
        layer.quant_method.process_weights_after_loading(layer)
    qkv = QKVParallelLinear(256, 32, 4, 2, quant_config=_Config(), prefix="model.layers.0.self_attn.qkv_proj")
    _feed(qkv, (_raw(128, 256, T.Q8_0, 9)[0], T.Q8_0), "q")
    with pytest.raises(ValueError, match=r"qkv_proj \[k\]: the GGUF file gave no tensor"):
        qkv.quant_method.process_weights_after_loading(qkv)


def test_the_embedding_and_an_untied_head_of_one_table():
    raw, w = _raw(40, 256, T.Q5_K, 10)
    embed = VocabParallelEmbedding(40, 256, quant_config=_Config())
    head = ParallelLMHead(40, 256, quant_config=_Config())
    for layer in (embed, head):
        _feed(layer, (raw, T.Q5_K))
        layer.quant_method.process_weights_after_loading(layer)
    ids = torch.tensor([3, 39, 3])
    assert torch.equal(embed(ids), w[ids])
    x = torch.randn(2, 256)
    torch.testing.assert_close(head(x), F.linear(x, w), atol=1e-3, rtol=0)
    assert "gguf_rows" not in head.__dict__ and "gguf_head" not in embed.__dict__


def test_the_config_needs_the_file():
    with pytest.raises(ValueError, match="must name its file"):
        GGUFConfig.from_config({"quant_method": "gguf"})
    assert GGUFConfig.from_config({"quant_method": "gguf", "gguf_file": "/x.gguf"}).gguf_file == "/x.gguf"


def test_a_rank_that_would_cut_a_block_is_refused_naming_the_layer_and_the_sizes():
    # Q4_K's super-blocks hold 256 weights: 256 input features over 2 ranks leave each half a block.
    row = RowParallelLinear(256, 64, tp_size=2, tp_rank=1, quant_config=_Config(), prefix="model.layers.0.mlp.down")
    _feed(row, (_raw(64, 256, T.Q4_K, 10)[0], T.Q4_K))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down: tensor_parallel_size=2 gives each rank 128 of "
                                         r"its 256 input features, which is not a multiple of Q4_K's block of 256"):
        row.quant_method.process_weights_after_loading(row)


def test_a_bfloat16_head_gives_float32_logits_without_rounding_them_to_bfloat16():
    """Logits leave a quantized head in float32 straight from the kernel: rounding them to the model's bf16 and back
    (two passes over [rows, vocab], a tenth of a batch-128 decode step) would also throw their low bits away."""
    raw, w = _raw(64, 256, T.Q4_0, 11)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the model's dtype, as the loader sets it while building layers
    try:
        head = ParallelLMHead(64, 256, quant_config=_Config())
    finally:
        torch.set_default_dtype(default)
    _feed(head, (raw, T.Q4_0))
    head.quant_method.process_weights_after_loading(head)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    logits = head(x)
    assert logits.dtype == torch.float32
    assert not torch.equal(logits, logits.bfloat16().float())
    torch.testing.assert_close(logits, F.linear(x.float(), w), atol=0.05, rtol=0.01)
