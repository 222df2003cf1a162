"""GGUFWeights: a GGUF file's tensors under vx's Hugging Face names, as views of the file; q/k rows back in HF order;
types and architectures vx cannot load refused before anything is built, naming what is wrong."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from safetensors.torch import load_file

from vx.models.gguf_weights import GGUFWeights, gguf_to_hf_names
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


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.IQ4_XS])
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
