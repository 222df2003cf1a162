"""A GGUF file's config directory (vx.models.gguf.config): the family fields transformers' GGUF mapping leaves out are read
from the file as llama.cpp writes them, so the config equals its Hugging Face twin's (DeepSeek-V2's, which
transformers does not map, wholly from its metadata); files vx cannot serve are refused by architecture."""

from __future__ import annotations

import json

import pytest
from gguf import ExpertGatingFuncType, GGUFWriter
from transformers import AutoConfig

from vx.config import hf_head_dim
from vx.models.gguf.config import family_config, write_gguf_config

# The fields each family's model reads beyond Llama's, checked against the float twin's config.
FAMILY_FIELDS = {
    "gemma2": ("sliding_window", "layer_types", "attn_logit_softcapping", "final_logit_softcapping",
               "query_pre_attn_scalar", "head_dim", "hidden_activation", "tie_word_embeddings"),
    "phi3": ("partial_rotary_factor", "original_max_position_embeddings", "max_position_embeddings",
             "sliding_window", "tie_word_embeddings"),
    "qwen3_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
                  "decoder_sparse_step", "rope_parameters", "tie_word_embeddings"),
    "mixtral": ("num_local_experts", "num_experts_per_tok", "intermediate_size", "sliding_window", "rope_parameters",
                "tie_word_embeddings"),
}
ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "phi3": "Phi3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM"}


@pytest.mark.parametrize("family", list(FAMILY_FIELDS))
def test_the_config_read_from_the_file_has_the_familys_fields(tiny_gguf, tmp_path, family):
    tiny = tiny_gguf("Q8_0", family=family)
    write_gguf_config(tiny.gguf_path, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        written = json.load(f)
    assert written["architectures"] == [ARCHITECTURES[family]]
    # Q8_0 o_proj/down_proj rows: blocks of 32, which each tensor-parallel rank's share of a row must be whole of.
    assert written["quantization_config"] == {"quant_method": "gguf", "gguf_file": tiny.gguf_path,
                                              "row_parallel_block": 32}
    got, twin = AutoConfig.from_pretrained(tmp_path), AutoConfig.from_pretrained(tiny.float_dir)
    assert got.model_type == twin.model_type
    for field in FAMILY_FIELDS[family]:
        assert getattr(got, field) == getattr(twin, field), field
    assert hf_head_dim(got) == hf_head_dim(twin)  # the file states it; a twin may leave it to hidden / heads
    if family == "phi3":  # LongRoPE's factors went through the file as float32
        rope, expected = got.rope_parameters, twin.rope_parameters
        assert rope["rope_type"] == "longrope" and rope["partial_rotary_factor"] == expected["partial_rotary_factor"]
        for key in ("long_factor", "short_factor"):
            assert rope[key] == pytest.approx(expected[key], rel=1e-6)


def _metadata_only(path, arch: str, **fields) -> str:
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(fields["layers"])
    writer.add_embedding_length(fields["hidden"])
    writer.add_head_count(fields["heads"])
    writer.add_head_count_kv(fields["heads"])
    writer.add_key_length(fields["head_dim"])
    writer.add_value_length(fields["head_dim"])
    writer.add_feed_forward_length(4 * fields["hidden"])
    writer.add_context_length(8192)
    writer.add_vocab_size(256)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize(("arch", "layers", "hidden", "heads", "head_dim", "scalar"),
                         [("gemma2", 26, 2304, 8, 256, 256), ("gemma2", 42, 3584, 16, 256, 256),
                          ("gemma2", 46, 4608, 32, 128, 144), ("gemma3", 34, 2560, 8, 256, 256),
                          ("gemma3", 62, 5376, 32, 128, 168)])
def test_gemmas_query_scale_is_llama_cpps_the_head_size_but_for_the_27b(tmp_path, arch, layers, hidden, heads,
                                                                        head_dim, scalar):
    """Gemma 2 2B, 9B, 27B and Gemma 3 4B, 27B shapes: their checkpoints' query_pre_attn_scalar, which a GGUF file
    does not store (transformers reads 256 whatever the model)."""
    path = _metadata_only(tmp_path / "g.gguf", arch, layers=layers, hidden=hidden, heads=heads, head_dim=head_dim)
    config = family_config(path, arch, AutoConfig.from_pretrained(tmp_path, gguf_file="g.gguf"))
    assert config.query_pre_attn_scalar == scalar
    second = "sliding_attention" if arch == "gemma3" else "full_attention"  # 5 sliding to 1 global; alternating
    assert config.layer_types[:2] == ["sliding_attention", second]
    assert len(config.layer_types) == layers


def test_an_architecture_vx_does_not_serve_is_refused_naming_it_and_the_supported_ones(tmp_path):
    path = _metadata_only(tmp_path / "f.gguf", "falcon", layers=2, hidden=64, heads=4, head_dim=16)
    with pytest.raises(ValueError, match=r"GGUF architecture 'falcon' is not supported; supported: llama, qwen2, "
                                         r"qwen3, qwen3moe, gemma2, gemma3, phi3, deepseek2\."):
        write_gguf_config(path, str(tmp_path / "out"))


# Fields transformers' own bookkeeping sets differently for a config written from a file.
_NOT_FROM_THE_FILE = ("_name_or_path", "dtype", "initializer_range", "quantization_config", "architectures")


@pytest.mark.parametrize(("family", "kv_b_form"), [("deepseek_v2", "kv_b"), ("deepseek_v2_qlora_yarn", "split")])
def test_a_deepseek_v2_files_config_equals_its_twins_in_either_converters_form(tiny_gguf, tmp_path, family,
                                                                              kv_b_form):
    """Older converters' lengths (expanded heads, attn_kv_b) and newer ones' (one KV head of the latent, the heads'
    lengths in the _mla keys, attn_k_b / attn_v_b); a q low rank or none; grouped or plain top-k; YaRN with
    mscale_all_dim through its log multiplier: transformers maps none of it, and every field equals the twin's."""
    tiny = tiny_gguf("Q8_0", family=family, kv_b_form=kv_b_form)
    write_gguf_config(tiny.gguf_path, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["architectures"] == ["DeepseekV2ForCausalLM"]
    got, twin = AutoConfig.from_pretrained(tmp_path).to_dict(), AutoConfig.from_pretrained(tiny.float_dir).to_dict()
    for field in _NOT_FROM_THE_FILE:
        got.pop(field, None), twin.pop(field, None)
    assert got == twin


def test_a_deepseek_v3_style_file_is_refused_naming_its_routing(tmp_path):
    writer = GGUFWriter(str(tmp_path / "v3.gguf"), "deepseek2")
    writer.add_block_count(2)
    writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"deepseek2\.expert_gating_func = sigmoid.*noaux_tc"):
        write_gguf_config(str(tmp_path / "v3.gguf"), str(tmp_path / "out"))


@pytest.mark.parametrize("family", ["gemma2", "phi3", "qwen3_moe"])
def test_transformers_own_gguf_loader_reads_the_tiny_files_as_their_twins(tiny_gguf, tmp_path, family):
    """The test files follow llama.cpp's conventions as transformers (independently of vx) reads them too: given vx's
    config, its GGUF loader gives the float twin's logits exactly (Gemma's norms plus one, Phi-3's fused rows, the
    stacked experts). Mixtral is left out: transformers has no GGUF reading of it."""
    import torch
    from transformers import AutoModelForCausalLM

    tiny = tiny_gguf("Q8_0", family=family)
    write_gguf_config(tiny.gguf_path, str(tmp_path))
    config = AutoConfig.from_pretrained(tmp_path)
    del config.quantization_config
    folder, name = tiny.gguf_path.rsplit("/", 1)
    from_file = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    twin = AutoModelForCausalLM.from_pretrained(tiny.float_dir, dtype=torch.float32,
                                                attn_implementation="eager").eval()
    ids = torch.randint(3, tiny.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(from_file(ids).logits, twin(ids).logits)
