"""vx.config.checkpoint_files: a config that claims more than its weight files hold (layers they have no tensors of, an
embedding of another shape, more weights than their bytes can store) is refused from the files' headers alone, by
the config (light or not) before anything is built; a GGUF file's keys the same way, and its shape's ranges."""

from __future__ import annotations

import os

import pytest
from tests.support.hostile_models import with_config, write_small_gguf

from vx.config.checkpoint_files import (check_checkpoint, check_gguf_file, checked_gguf_header, gguf_config_fields,
                                 safetensors_shapes)
from vx.config import EngineArgs

# The tiny Qwen3 of tests/conftest.py: 2 layers, hidden 64, a 512-token vocabulary.


@pytest.mark.parametrize("light", [True, False])
@pytest.mark.parametrize("change, message", [
    (dict(num_hidden_layers=500, layer_types=["full_attention"] * 500),
     r"num_hidden_layers=500, but the weights hold tensors of 2 layers \(none of layer 2\)"),
    (dict(vocab_size=1024), r"vocab_size=1024, but the token embedding holds 512 \(rows\)"),
    (dict(hidden_size=128), r"hidden_size=128, but the token embedding holds 64 \(columns\)"),
    # A float checkpoint holds a byte a weight at least (float8): 8x what its files hold is refused, not only 64x.
    (dict(intermediate_size=8192), r"the config implies at least [\d,]+ weights, which [\d,]+ bytes of weight "
                                   r"files cannot hold \(at 8 bits a weight, the least their format takes\)"),
])
def test_a_config_claiming_more_than_its_files_hold_is_refused(tiny_model_dir, tmp_path, light, change, message):
    path = with_config(tiny_model_dir, tmp_path / "m", **change)
    with pytest.raises(ValueError, match=f"{path}/config.json: {message}"):
        EngineArgs(model=path, device="cpu").create_config(light=light)


def test_the_tiny_models_match_their_files(tiny_model_dirs):
    for path in tiny_model_dirs.values():
        config = EngineArgs(model=path, device="cpu").create_config(light=True)
        check_checkpoint(path, config.model_config.hf_config)


def test_an_unreadable_safetensors_header_is_refused_naming_the_file(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match=r"Cannot read weights file .*model\.safetensors.*a header of 1099511627776"):
        safetensors_shapes(str(bad))
    bad.write_bytes((4).to_bytes(8, "little") + b"[1] ")
    with pytest.raises(ValueError, match=r"Cannot read weights file .*model\.safetensors"):
        safetensors_shapes(str(bad))


def test_a_gguf_config_directory_is_not_checked_against_safetensors(tmp_path):
    """Its file was checked when the directory was written: it has no safetensors files to check."""
    check_checkpoint(str(tmp_path), {"num_hidden_layers": 2, "quantization_config": {"quant_method": "gguf"}})
    with pytest.raises(ValueError, match="No \\*\\.safetensors weights"):
        check_checkpoint(str(tmp_path), {"num_hidden_layers": 2})


def test_a_consistent_gguf_file_passes_with_its_header(tmp_path):
    header = check_gguf_file(write_small_gguf(tmp_path / "ok.gguf"))
    assert header.architecture == "llama" and header.array_lengths["tokenizer.ggml.tokens"] == 16
    fields, names = gguf_config_fields(header)  # no llama.vocab_size key: the token list's length
    assert (fields["vocab_size"], names["vocab_size"]) == (16, "the length of tokenizer.ggml.tokens")
    assert fields == dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=pytest.approx(1e-6),
                          rope_theta=10000.0, vocab_size=16)


@pytest.mark.parametrize("write, message", [
    (dict(layers_stated=200), r"llama\.block_count=200, but the weights hold tensors of 2 layers"),
    (dict(layers_stated=10**9), r"llama\.block_count=1000000000 is out of range"),
    (dict(**{"llama.embedding_length": 128}), r"llama\.embedding_length=128, but the token embedding holds 64 "
                                               r"\(columns\)"),
    (dict(**{"llama.vocab_size": 32}), r"llama\.vocab_size=32, but the token embedding holds 16 \(rows\)"),
    (dict(**{"llama.feed_forward_length": 1 << 20}), r"the config implies at least [\d,]+ weights, which [\d,]+ "
                                                     r"bytes of weight files cannot hold \(at 1 bit a weight"),
    (dict(**{"llama.attention.head_count": 0}), r"llama\.attention\.head_count=0 is out of range"),
    (dict(**{"llama.attention.head_count_kv": 3}), r"llama\.attention\.head_count_kv=3 does not divide"),
    (dict(**{"llama.attention.layer_norm_rms_epsilon": float("nan")}),
     r"llama\.attention\.layer_norm_rms_epsilon=nan is not a finite number"),
    (dict(**{"llama.rope.freq_base": -1.0}), r"llama\.rope\.freq_base=-1\.0 must be positive"),
    (dict(**{"llama.context_length": 10**12}), r"llama\.context_length=1000000000000 is out of range"),
    (dict(**{"llama.vocab_size": 0}), r"llama\.vocab_size=0 is out of range"),
])
def test_a_gguf_file_claiming_what_it_does_not_hold_is_refused_naming_the_key(tmp_path, write, message):
    path = write_small_gguf(tmp_path / "bad.gguf", **write)
    with pytest.raises(ValueError, match=f"GGUF file '{path}': {message}"):
        check_gguf_file(path)


def test_the_config_writing_child_checks_ranges_only(tmp_path):
    """`python -m vx.models.gguf.config` runs on its own too: it refuses what would make its readers build huge lists,
    and leaves the tensors to the front end's check (its tests write files of metadata only)."""
    header, fields, names = checked_gguf_header(write_small_gguf(tmp_path / "few.gguf", layers_stated=200))
    assert fields["num_hidden_layers"] == 200 and names["num_hidden_layers"] == "llama.block_count"
    assert len(header.tensors) == 5 and os.path.getsize(tmp_path / "few.gguf") < 100_000
    with pytest.raises(ValueError, match=r"llama\.block_count=1000000000 is out of range"):
        checked_gguf_header(write_small_gguf(tmp_path / "huge.gguf", layers_stated=10**9))
