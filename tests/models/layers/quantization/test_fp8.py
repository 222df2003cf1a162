"""FP8 checkpoints built from a tiny model's weights: vx computes exactly what the same model with the dequantized
weights computes, with per-tensor and per-channel scales and either activation scheme; a fused layer takes one scale
per part, whether a part's scale arrives before or after its weight."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.quantized_checkpoints import fp8, quantized_pair
from tests.support.vx_outputs import greedy_tokens, load_vx, logits_difference, prompts
from vx.models.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from vx.models.layers.quantization import UnquantizedLinearMethod
from vx.models.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod

# On a CPU vx dequantizes at load: e4m3 value (exact in float32) times a float32 scale, the same product the twin's
# weights were made with, then the same float path. Only identical weights pass this.
LOGITS_ATOL = 1e-6


def fp8_config(static: bool = False, **extra) -> dict:
    return {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic", **extra}


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_computes_the_dequantized_model(float_model_dir, tmp_path, per_channel, static):
    quant_dir, twin_dir = quantized_pair(float_model_dir, tmp_path, fp8(per_channel, static), fp8_config(static))
    model = load_vx(quant_dir)
    layer = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer.quant_method, Fp8LinearMethod)
    assert layer.weight.dtype == torch.float32 and not hasattr(layer, "weight_scale")
    assert not hasattr(layer, "input_scale")
    diff, _ = logits_difference(model, load_vx(twin_dir))
    assert diff <= LOGITS_ATOL


def test_fp8_greedy_tokens_agree_with_the_dequantized_model(float_model_dir, tmp_path):
    quant_dir, twin_dir = quantized_pair(float_model_dir, tmp_path, fp8(), fp8_config())
    assert greedy_tokens(quant_dir, prompts(8)) == greedy_tokens(twin_dir, prompts(8))


def test_scales_that_arrive_before_their_weights(float_model_dir, tmp_path):
    """The checkpoint split in two files, every scale in the first: each fused part's scale is in before its
    weight."""
    quant_dir, twin_dir = quantized_pair(float_model_dir, tmp_path, fp8(static=True), fp8_config(static=True))
    tensors = load_file(os.path.join(quant_dir, "model.safetensors"))
    os.remove(os.path.join(quant_dir, "model.safetensors"))
    files = {"model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if k.endswith("_scale")},
             "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if not k.endswith("_scale")}}
    for name, part in files.items():
        save_file(part, os.path.join(quant_dir, name), metadata={"format": "pt"})
    with open(os.path.join(quant_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: name for name, part in files.items() for k in part}}, f)
    diff, _ = logits_difference(load_vx(quant_dir), load_vx(twin_dir))
    assert diff <= LOGITS_ATOL


def _fp8_part(out_features: int, seed: int) -> tuple[dict, torch.Tensor]:
    weight = torch.randn(out_features, 64, generator=torch.Generator().manual_seed(seed)) * (seed + 1)
    return fp8()(weight, "q_proj")


@pytest.mark.parametrize("scales_first", [False, True])
def test_each_fused_part_keeps_its_own_per_tensor_scale(scales_first):
    config = Fp8Config.from_config(fp8_config())
    qkv = QKVParallelLinear(64, 16, 4, 2, quant_config=config)
    merged = MergedColumnParallelLinear(64, [32, 32], quant_config=config)
    x = torch.randn(3, 64)
    for layer, parts in ((qkv, {"q": _fp8_part(64, 0), "k": _fp8_part(32, 1), "v": _fp8_part(32, 2)}),
                         (merged, {0: _fp8_part(32, 3), 1: _fp8_part(32, 4)})):
        # Different magnitudes per part: one scale for the whole layer could not hold them all.
        assert len({float(tensors["weight_scale"]) for tensors, _ in parts.values()}) == len(parts)
        order = ("weight_scale", "weight") if scales_first else ("weight", "weight_scale")
        for name in order:
            for sid, (tensors, _) in parts.items():
                getattr(layer, name).weight_loader(getattr(layer, name), tensors[name], sid)
        layer.quant_method.process_weights_after_loading(layer)
        expected = torch.cat([w for _, w in parts.values()])
        torch.testing.assert_close(layer(x), x @ expected.T, rtol=1e-5, atol=1e-5)


def test_ignored_layers_stay_float(float_model_dir, tmp_path):
    quant_dir, twin_dir = quantized_pair(float_model_dir, tmp_path, fp8(), fp8_config(ignored_layers=["o_proj"]),
                                         keep_float=("o_proj",))
    model = load_vx(quant_dir)
    assert isinstance(model.model.layers[1].self_attn.o_proj.quant_method, UnquantizedLinearMethod)
    diff, _ = logits_difference(model, load_vx(twin_dir))
    assert diff <= LOGITS_ATOL


def test_block_wise_fp8_is_refused():
    with pytest.raises(ValueError, match=r"Block-wise FP8 checkpoints \(weight_block_size=\[128, 128\]\)"):
        Fp8Config.from_config(fp8_config(weight_block_size=[128, 128]))


def test_a_weight_that_is_not_e4m3_is_refused():
    layer = QKVParallelLinear(64, 16, 4, 2, quant_config=Fp8Config.from_config(fp8_config()))
    with pytest.raises(ValueError, match="weight is torch.float8_e5m2; vx loads float8_e4m3fn"):
        layer.weight.weight_loader(layer.weight, torch.zeros(64, 64, dtype=torch.float8_e5m2), "q")


def test_quantization_fp8_on_a_float_checkpoint_is_refused(float_model_dir):
    with pytest.raises(ValueError, match="quantization='fp8' loads FP8 checkpoints"):
        load_vx(float_model_dir, quantization="fp8")
