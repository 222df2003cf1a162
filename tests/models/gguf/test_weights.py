"""GGUFWeights: a GGUF file's tensors under vx's Hugging Face names, as views of the file; q/k rows back in HF order;
DeepSeek-V2's MLA up-projection and router dequantized; types and architectures vx cannot load refused before anything
is built, naming what is wrong."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from safetensors.torch import load_file

from vx.models.gguf.weights import GGUFWeights, gguf_to_hf_names
from vx.models.layers.quantization.gguf_blocks import dequantize

T = GGMLQuantizationType
CONFIG = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)


def _write(path, arch: str, tensors: dict[str, tuple[np.ndarray, int | None]]) -> str:
    writer = GGUFWriter(str(path), arch)
    for name, (data, raw_dtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_every_tensor_arrives_under_its_hf_name_with_q_and_k_rows_in_hf_order(tiny_gguf):
    tiny = tiny_gguf("Q4_K_M")
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    reference = load_file(f"{tiny.float_dir}/model.safetensors")
    weights = GGUFWeights(tiny.gguf_path, config)
    got = dict(weights)
    weights.close()
    quantized = {n.removesuffix(".qweight") for n in got if n.endswith(".qweight")}
    floats = {n for n in got if not n.endswith((".qweight", ".qweight_type"))}
    assert {f"{n}.weight" for n in quantized} | floats == set(reference)
    assert all(n.endswith("norm.weight") for n in floats)
    for module in quantized:
        raw, ggml_type = got[f"{module}.qweight"], int(got[f"{module}.qweight_type"])
        assert raw.dtype == torch.uint8
        # q and k come back un-permuted: their rows dequantize to the reference, exactly.
        assert torch.equal(dequantize(raw, ggml_type), reference[f"{module}.weight"]), module
    assert torch.equal(got["model.layers.1.input_layernorm.weight"], reference["model.layers.1.input_layernorm.weight"])


def test_the_token_table_stays_readable_after_loading_lets_its_pages_go(tiny_gguf):
    tiny = tiny_gguf("Q8_0")
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    weights = GGUFWeights(tiny.gguf_path, config)
    table = dict(weights)["model.embed_tokens.qweight"]
    before = table.clone()
    weights.close()  # drops the resident pages; the view reads them back from the file
    assert torch.equal(table, before)


def test_the_name_map_covers_the_llama_family():
    names = gguf_to_hf_names("qwen3", 2)
    assert names["blk.1.attn_q_norm"] == "model.layers.1.self_attn.q_norm"
    assert names["token_embd"] == "model.embed_tokens" and names["output"] == "lm_head"
    assert names["blk.0.ffn_down"] == "model.layers.0.mlp.down_proj"


def test_tensors_vx_has_no_place_for_are_ignored_with_a_warning(tmp_path, caplog):
    path = _write(tmp_path / "m.gguf", "llama", {
        "output_norm.weight": (np.ones(256, np.float32), None),
        "rope_freqs.weight": (np.ones(32, np.float32), None)})
    with caplog.at_level(logging.WARNING):
        got = dict(GGUFWeights(path, CONFIG))
    assert list(got) == ["model.norm.weight"]
    assert "rope_freqs.weight" in caplog.text


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.IQ4_NL])
def test_an_unsupported_type_is_refused_naming_it_and_the_tensor(tmp_path, qtype):
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, (8, 256 // block * size), dtype=np.uint8)
    path = _write(tmp_path / "m.gguf", "llama", {"output_norm.weight": (np.ones(256, np.float32), None),
                                                 "blk.0.ffn_up.weight": (raw, qtype)})
    with pytest.raises(ValueError, match=rf"'blk\.0\.ffn_up\.weight'.*has type {qtype.name}, which vx cannot load"):
        GGUFWeights(path, CONFIG)


def test_other_bad_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        GGUFWeights(str(tmp_path / "gone.gguf"), CONFIG)
    path = _write(tmp_path / "gpt2.gguf", "gpt2", {"output_norm.weight": (np.ones(8, np.float32), None)})
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        GGUFWeights(path, CONFIG)
    raw = np.zeros((4, 18), np.uint8)
    path = _write(tmp_path / "q.gguf", "llama", {"output_norm.weight": (raw[0], T.Q4_0)})
    with pytest.raises(ValueError, match="is 1-D of type Q4_0"):
        GGUFWeights(path, CONFIG)


def _moe_config(family: str) -> Any:
    from tests.support.tiny_models import make_tiny_config

    return make_tiny_config(family, mlp_only_layers=[], moe_intermediate_size=64)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_quantized_experts_arrive_dequantized_expert_by_expert_and_the_rest_stays_quantized(tiny_gguf, family,
                                                                                           caplog):
    tiny = tiny_gguf("Q8_0", family=family)
    config = _moe_config(family)
    reference = load_file(f"{tiny.float_dir}/model.safetensors")
    with caplog.at_level(logging.INFO, logger="vx.models.gguf.weights"):
        weights = GGUFWeights(tiny.gguf_path, config, torch.bfloat16)
    got = dict(weights)
    weights.close()
    experts = {n: t for n, t in got.items() if ".experts." in n}
    num = config.num_experts if family == "qwen3_moe" else config.num_local_experts
    inter = config.moe_intermediate_size if family == "qwen3_moe" else config.intermediate_size
    layers = config.num_hidden_layers
    assert len(experts) == layers * num * 3
    for layer in range(layers):
        # The float twin stores them as saved by transformers: one tensor per expert and projection.
        for e in range(num):
            prefix = f"model.layers.{layer}.mlp.experts.{e}"
            for proj in ("gate_proj", "up_proj", "down_proj"):
                tensor = experts[f"{prefix}.{proj}.weight"]
                assert tensor.dtype == torch.float32  # dequantized by gguf; the stack keeps the model's dtype
                assert torch.equal(tensor, _twin_expert(reference, layer, e, proj, inter)), (prefix, proj)
        # The router and the attention stay GGUF tensors, quantized as the file holds them.
        assert int(got[f"model.layers.{layer}.mlp.gate.qweight_type"]) == T.Q8_0
        assert int(got[f"model.layers.{layer}.self_attn.q_proj.qweight_type"]) == T.Q8_0
    lines = [r for r in caplog.records if "expert" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    float_mib = layers * num * 3 * inter * config.hidden_size * 2 / 2**20
    assert f"{layers * 3} quantized GGUF expert tensors (Q8_0" in lines[0].getMessage()
    assert f"{float_mib:.1f} MiB in bfloat16" in lines[0].getMessage()


def _twin_expert(reference: dict[str, torch.Tensor], layer: int, expert: int, proj: str, inter: int) -> torch.Tensor:
    """One expert's projection from the float twin, whichever way transformers saved the experts."""
    single = f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"
    if single in reference:
        return reference[single]
    legacy = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj]
    for name in (f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{legacy}.weight",):
        if name in reference:
            return reference[name]
    if proj == "down_proj":
        return reference[f"model.layers.{layer}.mlp.experts.down_proj"][expert]
    gate_up = reference[f"model.layers.{layer}.mlp.experts.gate_up_proj"][expert]
    return gate_up[:inter] if proj == "gate_proj" else gate_up[inter:]


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.IQ4_NL])
def test_experts_load_in_types_the_dense_kernels_lack_through_the_gguf_package(tmp_path, qtype):
    from gguf import GGML_QUANT_SIZES, quants

    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, (2, 4, 256 // block * size), dtype=np.uint8)
    path = _write(tmp_path / "m.gguf", "qwen3moe", {"blk.0.ffn_down_exps.weight": (raw, qtype)})
    got = dict(GGUFWeights(path, CONFIG))
    assert list(got) == [f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(2)]
    with np.errstate(invalid="ignore", over="ignore"):  # random f16 scales may be NaN or inf
        for e in range(2):
            np.testing.assert_array_equal(got[f"model.layers.0.mlp.experts.{e}.down_proj.weight"].numpy(),
                                          quants.dequantize(raw[e], qtype))


def test_experts_of_a_type_the_gguf_package_cannot_dequantize_are_refused_at_open(tmp_path):
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[T.Q8_K]  # llama.cpp's intermediate type: gguf has no dequantizer for it
    raw = np.zeros((2, 4, 256 // block * size), np.uint8)
    path = _write(tmp_path / "m.gguf", "qwen3moe", {"blk.0.ffn_up_exps.weight": (raw, T.Q8_K)})
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_up_exps\.weight'.*cannot dequantize"):
        GGUFWeights(path, CONFIG)


def test_phi3s_fused_tensors_arrive_as_their_projections_cut_by_whole_rows(tiny_gguf):
    from tests.support.tiny_models import make_tiny_config

    tiny = tiny_gguf("Q8_0", family="phi3")
    config = make_tiny_config("phi3")
    reference = load_file(f"{tiny.float_dir}/model.safetensors")
    weights = GGUFWeights(tiny.gguf_path, config)
    got = dict(weights)
    weights.close()
    assert not any("qkv_proj" in n or "gate_up_proj" in n or "rope_factors" in n for n in got)
    q, kv, inter = 64, 32, config.intermediate_size
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        qkv = reference[f"{prefix}.self_attn.qkv_proj.weight"]
        gate_up = reference[f"{prefix}.mlp.gate_up_proj.weight"]
        parts = {"self_attn.q_proj": qkv[:q], "self_attn.k_proj": qkv[q:q + kv], "self_attn.v_proj": qkv[q + kv:],
                 "mlp.gate_proj": gate_up[:inter], "mlp.up_proj": gate_up[inter:]}
        for module, rows in parts.items():
            raw, ggml_type = got[f"{prefix}.{module}.qweight"], int(got[f"{prefix}.{module}.qweight_type"])
            assert torch.equal(dequantize(raw, ggml_type), rows), module


def test_the_name_map_covers_the_newer_families():
    qwen3moe = gguf_to_hf_names("qwen3moe", 1)
    assert qwen3moe["blk.0.ffn_gate_inp"] == "model.layers.0.mlp.gate"
    assert qwen3moe["blk.0.ffn_up_exps"] == "model.layers.0.mlp.experts.up_proj"
    assert gguf_to_hf_names("llama", 1)["blk.0.ffn_down_exps"] == "model.layers.0.mlp.experts.down_proj"
    phi3 = gguf_to_hf_names("phi3", 1)
    assert phi3["blk.0.attn_qkv"] == "model.layers.0.self_attn.qkv_proj"
    assert phi3["blk.0.ffn_up"] == "model.layers.0.mlp.gate_up_proj"
    assert gguf_to_hf_names("gemma2", 1)["blk.0.post_ffw_norm"] == "model.layers.0.post_feedforward_layernorm"
    # Only Phi-3 fuses: another family's ffn_up is its up projection.
    assert gguf_to_hf_names("gemma2", 1)["blk.0.ffn_up"] == "model.layers.0.mlp.up_proj"


def test_an_architecture_vx_does_not_serve_is_refused_by_name(tmp_path):
    path = _write(tmp_path / "f.gguf", "falcon", {"output_norm.weight": (np.ones(8, np.float32), None)})
    with pytest.raises(ValueError, match=r"'falcon' is not supported; supported: llama, .*qwen3moe, gemma2, gemma3, "
                                         r"phi3, deepseek2\."):
        GGUFWeights(path, CONFIG)


@pytest.mark.parametrize("kv_b_form", ["kv_b", "split"])
def test_deepseek_v2_loads_quantized_but_its_mla_up_projection_and_router_in_float(tiny_gguf, kv_b_form, caplog):
    """q_a / q_b / kv_a / o, the dense and shared-expert MLPs stay GGUF tensors; kv_b_proj (read per head by the MLA
    backend), from attn_kv_b or rebuilt from newer converters' attn_k_b (transposed) and attn_v_b, and the float32
    router arrive dequantized, equal to the twin's."""
    from tests.support.tiny_models import make_tiny_config

    family = "deepseek_v2_qlora_yarn"
    tiny = tiny_gguf("Q8_0", family=family, kv_b_form=kv_b_form)
    config = make_tiny_config(family, q_lora_rank=32)
    reference = load_file(f"{tiny.float_dir}/model.safetensors")
    with caplog.at_level(logging.INFO, logger="vx.models.gguf.weights"):
        weights = GGUFWeights(tiny.gguf_path, config)
    got = dict(weights)
    weights.close()
    assert not any(".k_b_proj" in n or ".v_b_proj" in n for n in got)
    quantized = ["self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.o_proj"]
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        kv_b = got[f"{prefix}.self_attn.kv_b_proj.weight"]
        assert kv_b.dtype == torch.float32 and torch.equal(kv_b, reference[f"{prefix}.self_attn.kv_b_proj.weight"])
        mlp = ["mlp.gate_proj", "mlp.down_proj"] if layer == 0 else ["mlp.shared_experts.up_proj",
                                                                     "mlp.shared_experts.down_proj"]
        for module in quantized + mlp:
            raw, ggml_type = got[f"{prefix}.{module}.qweight"], int(got[f"{prefix}.{module}.qweight_type"])
            assert ggml_type == T.Q8_0, module
            assert torch.equal(dequantize(raw, ggml_type), reference[f"{prefix}.{module}.weight"]), module
        assert torch.equal(got[f"{prefix}.self_attn.o_proj.bias"], reference[f"{prefix}.self_attn.o_proj.bias"])
    router = got["model.layers.1.mlp.gate.weight"]
    assert router.dtype == torch.float32 and torch.equal(router, reference["model.layers.1.mlp.gate.weight"])
    lines = [r.getMessage() for r in caplog.records if "MLA" in r.getMessage()]
    # Two Q8_0 kv_b (or v_b; the split k_b is F16: its 16-wide rows fill no Q8_0 block) and one router.
    assert len(lines) == 1 and "3 quantized GGUF MLA up-projection and router tensors (Q8_0" in lines[0]


def test_a_file_with_both_kv_b_forms_reads_the_whole_tensor(tmp_path):
    kv_b = np.arange(16 * 4, dtype=np.float32).reshape(16, 4)
    path = _write(tmp_path / "ds.gguf", "deepseek2", {
        "blk.0.attn_kv_b.weight": (kv_b, None),
        "blk.0.attn_k_b.weight": (np.zeros((4, 4, 2), np.float32), None),
        "blk.0.attn_v_b.weight": (np.zeros((4, 2, 4), np.float32), None)})
    got = dict(GGUFWeights(path, CONFIG))
    assert list(got) == ["model.layers.0.self_attn.kv_b_proj.weight"]
    assert torch.equal(got["model.layers.0.self_attn.kv_b_proj.weight"], torch.from_numpy(kv_b))


def test_half_of_a_split_kv_b_is_refused_naming_the_layer(tmp_path):
    path = _write(tmp_path / "ds.gguf", "deepseek2", {"blk.0.attn_k_b.weight": (np.zeros((4, 4, 2), np.float32), None)})
    with pytest.raises(ValueError, match=r"has k_b_proj but not both k_b_proj and v_b_proj \(attn_k_b, attn_v_b\) "
                                         r"for model\.layers\.0\.self_attn\.kv_b_proj"):
        GGUFWeights(path, CONFIG)


def test_early_mixtral_files_with_one_tensor_per_expert_load_as_the_stacked_ones(tmp_path):
    """Before llama.cpp stacked experts its converter wrote blk.N.ffn_gate.E: each arrives as that expert's float
    weight, dequantized when quantized."""
    from gguf import quants

    rng = np.random.default_rng(0)
    rows = {e: rng.standard_normal((8, 64)).astype(np.float32) for e in range(2)}
    stored = {e: quants.quantize(rows[e], T.Q8_0) for e in range(2)}
    path = _write(tmp_path / "m.gguf", "llama", {
        "blk.0.ffn_gate.0.weight": (stored[0], T.Q8_0), "blk.0.ffn_gate.1.weight": (stored[1], T.Q8_0),
        "blk.0.ffn_down.1.weight": (rows[1].astype(np.float16), None)})
    got = dict(GGUFWeights(path, CONFIG))
    for e in range(2):
        assert torch.equal(got[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"],
                           torch.from_numpy(quants.dequantize(stored[e], T.Q8_0)))
    down = got["model.layers.0.mlp.experts.1.down_proj.weight"]
    assert down.dtype == torch.float16 and torch.equal(down, torch.from_numpy(rows[1].astype(np.float16)))
