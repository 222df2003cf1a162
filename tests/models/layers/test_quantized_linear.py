"""The linear layers' contract with a quantization method: the method creates the parameters and computes, the
layer's loaders cut every tagged parameter (packed along the input, grouped scales, per-tensor) for its rank and
fused shard the same way they cut a float weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vx.models.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                     ReplicatedLinear, RowParallelLinear)
from vx.models.layers.quantization import (LinearMethodBase, QuantizationConfig, UnquantizedLinearMethod,
                                           get_quantization_config, set_weight_attrs)

GROUP = 4


class PairPackedMethod(LinearMethodBase):
    """A toy format: int8 codes two per entry along the input ([out, in / 2] int16), a scale per GROUP inputs
    ([out, in / GROUP]), and one per-tensor offset; w = code * scale + offset."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype):
        out = sum(output_partition_sizes)
        packed = nn.Parameter(torch.empty(out, input_size_per_partition // 2, dtype=torch.int16), requires_grad=False)
        scales = nn.Parameter(torch.empty(out, input_size_per_partition // GROUP), requires_grad=False)
        offset = nn.Parameter(torch.empty(()), requires_grad=False)
        for param, attrs in ((packed, {"output_dim": 0, "input_dim": 1}), (scales, {"output_dim": 0, "input_dim": 1}),
                             (offset, {})):
            set_weight_attrs(param, {**attrs, "weight_loader": layer.weight_loader})
        layer.register_parameter("packed", packed)
        layer.register_parameter("scales", scales)
        layer.register_parameter("offset", offset)

    def process_weights_after_loading(self, layer):
        codes = torch.stack([layer.packed.data & 0xFF, layer.packed.data >> 8], dim=-1).flatten(1).to(torch.int8)
        layer.dequantized = (codes.float() * layer.scales.repeat_interleave(GROUP, dim=1) + layer.offset)

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.dequantized, bias)


class PairPackedConfig(QuantizationConfig):
    name = "pair_packed"

    def __init__(self, skip: tuple[str, ...] = ()) -> None:
        self.skip = skip

    @classmethod
    def from_config(cls, quant_config):
        return cls(tuple(quant_config.get("skip", ())))

    def get_linear_method(self, layer, prefix):
        return None if prefix in self.skip else PairPackedMethod()


def pack(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [out, in] -> int16 [out, in / 2] (low byte first)."""
    c = codes.to(torch.int16) & 0xFF
    return c[:, 0::2] | (c[:, 1::2] << 8)


def quantized_checkpoint(out_features: int, in_features: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 100, (out_features, in_features), generator=g, dtype=torch.int8)
    scales = torch.rand(out_features, in_features // GROUP, generator=g) + 0.5
    offset = torch.tensor(0.25)
    weight = codes.float() * scales.repeat_interleave(GROUP, dim=1) + offset
    return {"packed": pack(codes), "scales": scales, "offset": offset}, weight


def load(layer, tensors, shard_id=None):
    for name, tensor in tensors.items():
        param = getattr(layer, name)
        if shard_id is None:
            param.weight_loader(param, tensor)
        else:
            param.weight_loader(param, tensor, shard_id)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_column_and_row_parallel_cut_packed_and_grouped_params(tp_rank):
    tensors, weight = quantized_checkpoint(8, 16, seed=1)
    column = ColumnParallelLinear(16, 8, tp_size=2, tp_rank=tp_rank, quant_config=PairPackedConfig())
    load(column, tensors)
    column.quant_method.process_weights_after_loading(column)
    torch.testing.assert_close(column.dequantized, weight[tp_rank * 4:(tp_rank + 1) * 4])

    row = RowParallelLinear(16, 8, tp_size=2, tp_rank=tp_rank, quant_config=PairPackedConfig())
    load(row, tensors)
    row.quant_method.process_weights_after_loading(row)
    torch.testing.assert_close(row.dequantized, weight[:, tp_rank * 8:(tp_rank + 1) * 8])


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_fused_layers_place_each_quantized_shard(tp_rank):
    gate, gate_w = quantized_checkpoint(8, 16, seed=2)
    up, up_w = quantized_checkpoint(8, 16, seed=3)
    merged = MergedColumnParallelLinear(16, [8, 8], tp_size=2, tp_rank=tp_rank, quant_config=PairPackedConfig())
    load(merged, gate, 0)
    load(merged, up, 1)
    merged.quant_method.process_weights_after_loading(merged)
    half = slice(tp_rank * 4, (tp_rank + 1) * 4)
    torch.testing.assert_close(merged.dequantized, torch.cat([gate_w[half], up_w[half]]))

    # 4 query heads and 2 KV heads of size 2 over 2 ranks.
    (q, q_w), (k, k_w), (v, v_w) = (quantized_checkpoint(8, 16, seed=4), quantized_checkpoint(4, 16, seed=5),
                                    quantized_checkpoint(4, 16, seed=6))
    qkv = QKVParallelLinear(16, 2, 4, 2, tp_size=2, tp_rank=tp_rank, quant_config=PairPackedConfig())
    for shard_id, tensors in (("q", q), ("k", k), ("v", v)):
        load(qkv, tensors, shard_id)
    qkv.quant_method.process_weights_after_loading(qkv)
    kv = slice(tp_rank * 2, (tp_rank + 1) * 2)
    torch.testing.assert_close(qkv.dequantized, torch.cat([q_w[tp_rank * 4:(tp_rank + 1) * 4], k_w[kv], v_w[kv]]))


def test_a_quantized_layer_computes_through_its_method_and_a_skipped_one_stays_float():
    tensors, weight = quantized_checkpoint(8, 16, seed=7)
    config = PairPackedConfig.from_config({"skip": ["model.head"]})
    layer = ReplicatedLinear(16, 8, bias=True, quant_config=config, prefix="model.proj")
    load(layer, tensors)
    layer.bias.weight_loader(layer.bias, torch.arange(8.0))
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(3, 16)
    torch.testing.assert_close(layer(x), x @ weight.T + torch.arange(8.0))
    assert not hasattr(layer, "weight")  # the method owns the parameters

    skipped = ReplicatedLinear(16, 8, quant_config=config, prefix="model.head")
    assert isinstance(skipped.quant_method, UnquantizedLinearMethod) and skipped.weight.shape == (8, 16)


def test_a_wrongly_shaped_quantized_tensor_is_refused():
    tensors, _ = quantized_checkpoint(8, 16, seed=8)
    layer = ColumnParallelLinear(16, 8, tp_size=2, quant_config=PairPackedConfig())
    with pytest.raises(ValueError, match="does not match"):
        layer.packed.weight_loader(layer.packed, tensors["packed"][:6])


def test_an_unknown_method_is_refused_naming_it():
    with pytest.raises(ValueError, match="Quantization method 'bitnet' is not supported"):
        get_quantization_config("bitnet", {"quant_method": "bitnet"})
    assert get_quantization_config(None, None) is None


def test_a_checkpoint_and_a_method_that_disagree_are_refused_naming_both():
    with pytest.raises(ValueError, match="quant_method='awq', but the engine was configured to load it with "
                                         "quantization=None"):
        get_quantization_config(None, {"quant_method": "awq", "bits": 4})
    with pytest.raises(ValueError, match="quant_method='gptq', but .* quantization='int8'"):
        get_quantization_config("int8", {"quant_method": "gptq"})
    assert get_quantization_config("int8", None).name == "int8"
