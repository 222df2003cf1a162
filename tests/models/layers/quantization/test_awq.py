"""AWQ checkpoints (GEMM layout) built from a tiny model's weights: vx computes what the same model with the
dequantized weights computes through the float path, for each group size, with and without zero points; the
modules the checkpoint leaves in float stay float; tensors shard for tensor parallelism like the float weight."""

from __future__ import annotations

import pytest
import torch

from tests.support.quantized_checkpoints import awq, quantized_pair
from tests.support.vx_outputs import (greedy_tokens, linear_weight_bytes, load_vx, logits_difference,
                                      prefill_logits, prompts)
from vx.models.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vx.models.layers.quantization import UnquantizedLinearMethod
from vx.models.layers.quantization.awq import AWQConfig, AWQLinearMethod

# Both sides compute in float32 with the same weights: vx as q * s + (-z * s) in torch's int4 kernel, the twin as
# (q - z) * s in F.linear. What differs is rounding (a few ulp a weight) and the order of the sums, which stays
# below 1e-4 on logits of magnitude ~13 through the 3 layers; a single misread code moves them by 1e-2 or more.
LOGITS_ATOL = 1e-3


def awq_config(group_size: int, zero_point: bool = True, **extra) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": zero_point,
            "version": "gemm", **extra}


@pytest.mark.parametrize("zero_point", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_computes_the_dequantized_model(float_model_dir, tmp_path, group_size, zero_point):
    quant_dir, twin_dir = quantized_pair(float_model_dir, tmp_path, awq(group_size, zero_point),
                                         awq_config(group_size, zero_point))
    model, twin = load_vx(quant_dir), load_vx(twin_dir)
    layer = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer.quant_method, AWQLinearMethod) and not hasattr(layer, "qweight")
    diff, scale = logits_difference(model, twin)
    assert diff <= LOGITS_ATOL, f"logits differ by {diff} (largest logit {scale})"
    # 4 bits a weight plus fp32 scale and zero per group, against 4 bytes a weight.
    assert linear_weight_bytes(model) < 0.2 * linear_weight_bytes(twin)


def test_awq_greedy_tokens_agree_with_the_dequantized_model(float_model_dir, tmp_path):
    quant_dir, twin_dir = quantized_pair(float_model_dir, tmp_path, awq(64), awq_config(64))
    assert greedy_tokens(quant_dir, prompts(8)) == greedy_tokens(twin_dir, prompts(8))


def test_modules_to_not_convert_stay_float(float_model_dir, tmp_path):
    quant_dir, twin_dir = quantized_pair(float_model_dir, tmp_path, awq(32), awq_config(
        32, modules_to_not_convert=["down_proj"]), keep_float=("down_proj",))
    model = load_vx(quant_dir)
    for layer in model.model.layers:
        assert isinstance(layer.mlp.down_proj.quant_method, UnquantizedLinearMethod)
        assert isinstance(layer.mlp.gate_up_proj.quant_method, AWQLinearMethod)
    diff, _ = logits_difference(model, load_vx(twin_dir))
    assert diff <= LOGITS_ATOL


def test_a_skip_list_that_splits_a_fused_layer_is_refused(float_model_dir, tmp_path):
    quant_dir, _ = quantized_pair(float_model_dir, tmp_path, awq(32), awq_config(
        32, modules_to_not_convert=["k_proj"]), keep_float=("k_proj",))
    with pytest.raises(ValueError, match=r"only some of the modules fused into model\.layers\.0\.self_attn\.qkv_proj"):
        load_vx(quant_dir)


@pytest.mark.parametrize("change, message", [
    ({"bits": 3}, "AWQ with 3-bit weights is not supported"),
    ({"version": "gemv"}, "'gemv' layout are not supported"),
    ({"group_size": 48}, "group_size=48 is not supported"),
])
def test_awq_variants_vx_cannot_read_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        AWQConfig.from_config({**awq_config(128), **change})


def test_quantization_awq_on_a_float_checkpoint_is_refused(float_model_dir):
    with pytest.raises(ValueError, match="quantization='awq' loads AWQ checkpoints"):
        load_vx(float_model_dir, quantization="awq")


def _awq_tensors(out_features: int, in_features: int, seed: int) -> tuple[dict, torch.Tensor]:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.1
    return awq(32)(weight, "")


def _load(layer, tensors, shard_id=None) -> None:
    for name, tensor in tensors.items():
        param = getattr(layer, name)
        param.weight_loader(param, tensor, *(() if shard_id is None else (shard_id,)))
    layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_awq_tensors_shard_like_the_float_weight(tp_rank):
    config = AWQConfig.from_config(awq_config(32))
    x = torch.randn(3, 128)
    tensors, weight = _awq_tensors(64, 128, seed=1)
    column = ColumnParallelLinear(128, 64, tp_size=2, tp_rank=tp_rank, quant_config=config)
    _load(column, tensors)
    torch.testing.assert_close(column(x), x @ weight[tp_rank * 32:(tp_rank + 1) * 32].T, rtol=1e-4, atol=1e-4)

    row = RowParallelLinear(128, 64, tp_size=2, tp_rank=tp_rank, quant_config=config)
    _load(row, tensors)  # each rank holds 64 input features: two groups of 32
    half = slice(tp_rank * 64, (tp_rank + 1) * 64)
    torch.testing.assert_close(row.quant_method.apply(row, x[:, half]), x[:, half] @ weight[:, half].T,
                               rtol=1e-4, atol=1e-4)

    # 4 query heads and 2 KV heads of 16 over 2 ranks: q, k and v each bring their own packed tensors.
    qkv = QKVParallelLinear(128, 16, 4, 2, tp_size=2, tp_rank=tp_rank, quant_config=config)
    parts = {sid: _awq_tensors(n, 128, seed=i) for i, (sid, n) in enumerate((("q", 64), ("k", 32), ("v", 32)))}
    for sid, (tensors, _) in parts.items():
        for name, tensor in tensors.items():
            getattr(qkv, name).weight_loader(getattr(qkv, name), tensor, sid)
    qkv.quant_method.process_weights_after_loading(qkv)
    q_rows, kv_rows = slice(tp_rank * 32, (tp_rank + 1) * 32), slice(tp_rank * 16, (tp_rank + 1) * 16)
    expected = torch.cat([parts["q"][1][q_rows], parts["k"][1][kv_rows], parts["v"][1][kv_rows]])
    torch.testing.assert_close(qkv(x), x @ expected.T, rtol=1e-4, atol=1e-4)


def test_awq_in_bfloat16(realistic_model_dir, tmp_path):
    """In bf16 the kernel holds s and -z * s rounded to 8 bits of mantissa each, the twin (q - z) * s rounded once:
    weights differ by up to ~2**-8 relative, observed 0.5% on the logits; 2% leaves room, a misread code does not."""
    quant_dir, twin_dir = quantized_pair(realistic_model_dir, tmp_path, awq(32), awq_config(32))
    got = prefill_logits(load_vx(quant_dir, torch.bfloat16), prompts(), torch.bfloat16)
    ref = prefill_logits(load_vx(twin_dir, torch.bfloat16), prompts(), torch.bfloat16)
    rel = (sum(float((a - b).pow(2).sum()) for a, b in zip(got, ref)) / sum(float(b.pow(2).sum()) for b in ref)) ** .5
    assert rel <= 0.02
