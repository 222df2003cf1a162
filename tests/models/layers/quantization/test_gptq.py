"""GPTQ checkpoints built from a tiny model's weights: vx computes what the same model with the dequantized weights
computes through the float path: 4-bit symmetric and asymmetric at each group size, both zero conventions (v1's
stored zero minus one, v2's zero), activation order (`desc_act`), 8-bit; unreadable variants are refused."""

from __future__ import annotations

import pytest
import torch

from tests.support.quantized_checkpoints import gptq, quantized_pair
from tests.support.vx_outputs import greedy_tokens, linear_weight_bytes, load_vx, logits_difference, prompts
from vx.models.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vx.models.layers.quantization.gptq import GPTQConfig, GPTQLinearMethod

# As for AWQ (test_awq.py): the same float32 weights on both sides, only rounding and summation order differ
# (observed below 1e-4 on logits of magnitude ~13; a misread code or zero moves them by 1e-2 or more). With
# desc_act the input is permuted first, which reorders the sums once more: observed ~2e-4.
LOGITS_ATOL = 1e-3


def gptq_config(group_size: int = 128, bits: int = 4, sym: bool = True, checkpoint_format: str = "gptq",
                desc_act: bool = False, **extra) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym, "desc_act": desc_act,
            "checkpoint_format": checkpoint_format, **extra}


def _check(float_model_dir, tmp_path, **options) -> torch.nn.Module:
    quant_dir, twin_dir = quantized_pair(float_model_dir, tmp_path, gptq(**options), gptq_config(**options))
    model, twin = load_vx(quant_dir), load_vx(twin_dir)
    layer = model.model.layers[0].mlp.gate_up_proj
    assert isinstance(layer.quant_method, GPTQLinearMethod) and not hasattr(layer, "qweight")
    diff, scale = logits_difference(model, twin)
    assert diff <= LOGITS_ATOL, f"logits differ by {diff} (largest logit {scale})"
    assert linear_weight_bytes(model) < (0.2 if options.get("bits", 4) == 4 else 0.6) * linear_weight_bytes(twin)
    return model


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_gptq_4bit_computes_the_dequantized_model(float_model_dir, tmp_path, group_size, sym):
    _check(float_model_dir, tmp_path, group_size=group_size, sym=sym)


def test_gptq_v2_zeros_are_read_as_stored(float_model_dir, tmp_path):
    _check(float_model_dir, tmp_path, group_size=64, sym=False, checkpoint_format="gptq_v2")


def test_gptq_with_activation_order(float_model_dir, tmp_path):
    model = _check(float_model_dir, tmp_path, group_size=32, desc_act=True)
    assert model.model.layers[0].self_attn.qkv_proj.input_perm.shape == (128,)


def test_gptq_8bit(float_model_dir, tmp_path):
    _check(float_model_dir, tmp_path, group_size=64, bits=8, sym=False)


def test_gptq_greedy_tokens_agree_with_the_dequantized_model(float_model_dir, tmp_path):
    options = dict(group_size=128, sym=False)
    quant_dir, twin_dir = quantized_pair(float_model_dir, tmp_path, gptq(**options), gptq_config(**options))
    assert greedy_tokens(quant_dir, prompts(8)) == greedy_tokens(twin_dir, prompts(8))


def test_reading_v1_zeros_as_v2_would_be_wrong(float_model_dir, tmp_path):
    """The zero convention matters: the same v1 tensors declared as v2 give other logits."""
    quant_dir, twin_dir = quantized_pair(float_model_dir, tmp_path, gptq(group_size=64, sym=False),
                                         gptq_config(group_size=64, sym=False, checkpoint_format="gptq_v2"))
    diff, _ = logits_difference(load_vx(quant_dir), load_vx(twin_dir))
    assert diff > 100 * LOGITS_ATOL


@pytest.mark.parametrize("change, message", [
    ({"bits": 3}, "GPTQ with 3-bit weights is not supported"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format='marlin' is not supported"),
    ({"lm_head": True}, "quantized lm_head are not supported"),
    ({"dynamic": {"-:.*down_proj": {}}}, "per-module overrides"),
])
def test_gptq_variants_vx_cannot_read_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        GPTQConfig.from_config({**gptq_config(), **change})


def test_modules_in_block_to_quantize_leaves_the_others_float(float_model_dir, tmp_path):
    options = dict(group_size=32, sym=False)
    config = gptq_config(**options, modules_in_block_to_quantize=[
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"]])
    quant_dir, twin_dir = quantized_pair(float_model_dir, tmp_path, gptq(**options), config, keep_float=("mlp",))
    model = load_vx(quant_dir)
    assert isinstance(model.model.layers[0].self_attn.o_proj.quant_method, GPTQLinearMethod)
    assert not isinstance(model.model.layers[0].mlp.down_proj.quant_method, GPTQLinearMethod)
    diff, _ = logits_difference(model, load_vx(twin_dir))
    assert diff <= LOGITS_ATOL


def _gptq_tensors(out_features: int, in_features: int, weight_seed: int, **options) -> tuple[dict, torch.Tensor]:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(weight_seed)) * 0.1
    return gptq(**options)(weight, "gate_proj")


def test_fused_parts_with_different_activation_orders_are_refused():
    config = GPTQConfig.from_config(gptq_config(32, desc_act=True))
    layer = MergedColumnParallelLinear(128, [64, 64], quant_config=config)
    gate, _ = _gptq_tensors(64, 128, 1, group_size=32, desc_act=True, seed=1)
    up, _ = _gptq_tensors(64, 128, 2, group_size=32, desc_act=True, seed=2)
    layer.g_idx.weight_loader(layer.g_idx, gate["g_idx"], 0)
    with pytest.raises(ValueError, match="g_idx differ"):
        layer.g_idx.weight_loader(layer.g_idx, up["g_idx"], 1)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_gptq_tensors_shard_along_the_input_like_the_float_weight(tp_rank):
    config = GPTQConfig.from_config(gptq_config(32, sym=False))
    tensors, weight = _gptq_tensors(64, 128, 3, group_size=32, sym=False)
    row = RowParallelLinear(128, 64, tp_size=2, tp_rank=tp_rank, quant_config=config)
    for name, tensor in tensors.items():
        getattr(row, name).weight_loader(getattr(row, name), tensor)
    row.quant_method.process_weights_after_loading(row)
    x = torch.randn(3, 64)
    half = slice(tp_rank * 64, (tp_rank + 1) * 64)
    torch.testing.assert_close(row.quant_method.apply(row, x), x @ weight[:, half].T, rtol=1e-4, atol=1e-4)
