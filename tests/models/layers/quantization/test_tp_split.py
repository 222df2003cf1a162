"""Which quantized models split over tensor-parallel ranks, checked from the config: each rank's slice of a
row-parallel layer's input must be whole blocks (GGUF) or groups (AWQ/GPTQ), and each rank's output features whole
packed words; a model that cannot is a ValueError naming the layer and the sizes, before any worker starts."""

from __future__ import annotations

import pytest

from vx.config import EngineArgs
from vx.models.layers.quantization.tp_split import SPLIT_METHODS, check_quantized_split

# A Llama-shaped config: 8 heads of 64 (o_proj K = 512), 2 KV heads, down_proj K = 1536.
LLAMA = dict(num_attention_heads=8, hidden_size=512, intermediate_size=1536)


def _check(method: str | None, tp: int, quant: dict | None = None, **shape) -> None:
    config = {**LLAMA, **shape, **({"quantization_config": quant} if quant else {})}
    check_quantized_split(method, config, tp, head_dim=config["hidden_size"] // config["num_attention_heads"],
                          kv_heads=2)


def test_formats_that_split_pass_when_each_rank_holds_whole_blocks():
    for method, quant, sizes in (("gguf", None, (2, 4, 8)), ("gguf", {"row_parallel_block": 256}, (2,)),
                                 ("awq", {"group_size": 128}, (2, 4)), ("gptq", {"bits": 4, "group_size": 128}, (2, 4)),
                                 ("gptq", {"bits": 8, "group_size": -1}, (2, 4, 8)), ("fp8", None, (2, 4, 8))):
        for tp in sizes:
            _check(method, tp, quant)
    _check(None, 2)
    assert set(SPLIT_METHODS) == {"gguf", "awq", "gptq", "fp8"}


@pytest.mark.parametrize("method, quant, tp, shape, message", [
    # 576 / 2 = 288 = 9 groups of 32, but not whole groups of 128.
    ("awq", {"group_size": 128}, 2, dict(hidden_size=576, num_attention_heads=9, intermediate_size=1536),
     r"self_attn\.o_proj has 576 input features, 288 per rank, which is not a multiple of the AWQ group_size of 128"),
    ("gptq", {"bits": 4, "group_size": 64}, 4, dict(intermediate_size=1440),
     r"mlp\.down_proj has 1440 input features, 360 per rank, which is not a multiple of the GPTQ group_size of 64"),
    # GGUF's smallest block is 32: 1504 / 2 = 752 is not whole blocks.
    ("gguf", None, 2, dict(intermediate_size=1504), r"mlp\.down_proj has 1504 input features, 752 per rank"),
    # A K-quant file (its config records blocks of 256): 512 / 4 = 128 is half a block.
    ("gguf", {"quant_method": "gguf", "row_parallel_block": 256}, 4, {},
     r"self_attn\.o_proj has 512 input features, 128 per rank, which is not a multiple of the GGUF file's block of "
     r"256"),
    # AWQ packs 8 output features a word: 2 KV heads of 20 over 2 ranks leave 20 k (and v) features a rank.
    ("awq", {"group_size": -1}, 2, dict(hidden_size=320, num_attention_heads=16, intermediate_size=2048),
     r"self_attn\.qkv_proj's output features per rank \[160, 20, 20\] are not all multiples of the 8 that AWQ "
     r"packs"),
    ("gptq", {"bits": 4, "group_size": 32, "desc_act": True}, 2, {}, "desc_act"),
    ("int8", None, 2, {}, r"quantized weights \(int8\) are not split .* these are: gguf, awq, gptq, fp8"),
    ("int4", None, 2, {}, r"quantized weights \(int4\) are not split"),
])
def test_a_model_that_cannot_be_split_is_refused_naming_the_layer_and_sizes(method, quant, tp, shape, message):
    with pytest.raises(ValueError, match=message):
        _check(method, tp, quant, **shape)


def test_a_mixture_of_experts_model_checks_only_its_dense_layers():
    # Mixtral's and an all-sparse Qwen3-MoE's intermediate_size is the experts' (float under GGUF): not checked.
    _check("gguf", 2, {"row_parallel_block": 256}, intermediate_size=1280, num_local_experts=8)
    _check("gguf", 2, {"row_parallel_block": 256}, intermediate_size=1280, num_experts=8, mlp_only_layers=[])
    with pytest.raises(ValueError, match=r"mlp\.down_proj has 1280 input features, 640 per rank"):
        _check("gguf", 2, {"row_parallel_block": 256}, intermediate_size=1280, num_experts=8, mlp_only_layers=[0])


def test_one_rank_and_pipeline_stages_need_no_alignment():
    _check("awq", 1, {"group_size": 128}, intermediate_size=1440)


def test_the_engine_config_refuses_quantizing_at_load_under_tensor_parallelism(tiny_model_dirs):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: quantized weights \(int8\) are not split"):
        EngineArgs(model=tiny_model_dirs["llama"], device="cpu", quantization="int8",
                   tensor_parallel_size=2).create_config(light=True)
