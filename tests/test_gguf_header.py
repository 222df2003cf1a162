"""The GGUF header reader: the same tensors, types, shapes and offsets as gguf.GGUFReader, without its parse of the
metadata; a file that is not GGUF, or is cut short, is a ValueError."""

from __future__ import annotations

import os

import pytest
from gguf import GGUFReader

from vx.gguf_header import read_gguf_header


def _reader_view(path: str) -> tuple[str, list[tuple]]:
    reader = GGUFReader(path)
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    return arch, [(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.data_offset), int(t.n_bytes))
                  for t in reader.tensors]


@pytest.mark.parametrize("types", ["Q4_K_M", "F16"])
def test_the_header_lists_what_gguf_reader_lists(tiny_gguf, types):
    path = tiny_gguf(types).gguf_path
    header = read_gguf_header(path)
    arch, tensors = _reader_view(path)
    assert header.architecture == arch == "llama"
    assert [(t.name, t.ggml_type, t.dims, t.offset, t.nbytes) for t in header.tensors] == tensors


def test_the_default_models_header(default_model_dir):
    from vx.model_source import default_model_file

    path = default_model_file()
    header = read_gguf_header(path)
    arch, tensors = _reader_view(path)
    assert header.architecture == arch
    assert [(t.name, t.ggml_type, t.dims, t.offset, t.nbytes) for t in header.tensors] == tensors


def test_not_gguf_and_truncated_files_are_refused(tiny_gguf, tmp_path):
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + os.urandom(64))
    with pytest.raises(ValueError, match="not a readable GGUF file: no GGUF magic"):
        read_gguf_header(str(not_gguf))
    data = open(tiny_gguf("Q8_0").gguf_path, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 1000])
    with pytest.raises(ValueError, match="runs past the end of the file"):
        read_gguf_header(str(cut))
    cut.write_bytes(data[:200])  # inside the metadata
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        read_gguf_header(str(cut))


@pytest.mark.parametrize("family", ["gemma2", "phi3", "qwen3_moe"])
def test_the_values_under_a_key_prefix_are_what_gguf_reader_reads(tiny_gguf, family):
    """Scalars of every kind the families use (u32 counts, f32 caps and eps, strings) as GGUFReader decodes them;
    arrays and other prefixes left out."""
    path = tiny_gguf("Q8_0", family=family).gguf_path
    arch = read_gguf_header(path).architecture
    header = read_gguf_header(path, f"{arch}.")
    reader = GGUFReader(path)
    expected = {key: field.contents() for key, field in reader.fields.items()
                if key.startswith(f"{arch}.") and not isinstance(field.contents(), list)}
    assert header.metadata == expected and len(expected) >= 8
    assert read_gguf_header(path).metadata == {}
