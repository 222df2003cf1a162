"""The GGUF header reader: the same tensors, types, shapes and offsets as gguf.GGUFReader, without its parse of the
metadata; a file that is not GGUF, is cut short, or holds more than vx's limits (keys, array items, strings and
their bytes, tensors) is a ValueError naming the key and the limit."""

from __future__ import annotations

import os
import struct
import time

import pytest
from gguf import GGUF_MAGIC, GGUFReader, GGUFValueType
from tests.support.hostile_models import write_string_bomb

from vx.models.gguf.header import GGUFLimits, read_gguf_header

TOKENS = 400  # the tiny tokenizer's vocabulary (tests.support.tiny_tokenizer)


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
    from vx.config.model_source import default_model_file

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


# ------------------------------------------------------------------------------------------------------- limits
def test_a_string_bomb_is_refused_by_its_count_before_anything_is_stepped_over(tmp_path):
    """5M empty vocabulary strings: 40 MB on disk, a Python object each once a reader materializes them."""
    path = write_string_bomb(tmp_path / "bomb.gguf")
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"GGUF file '{path}' is refused: an array of 5000000 items at key "
                                         r"'tokenizer\.ggml\.tokens' is over vx's limit of 1048576 "
                                         r"\(GGUFLimits\.max_array_items\)"):
        read_gguf_header(path)
    assert time.monotonic() - start < 0.5


@pytest.mark.parametrize("limits, message", [
    (GGUFLimits(max_keys=5), r"\d+ keys is over vx's limit of 5 \(GGUFLimits\.max_keys\)"),
    (GGUFLimits(max_tensors=3), r"\d+ tensors is over vx's limit of 3 \(GGUFLimits\.max_tensors\)"),
    (GGUFLimits(max_array_items=100),
     r"an array of \d+ items at key 'tokenizer\.ggml\.tokens' is over vx's limit of 100 \(GGUFLimits\.max_array"),
    # The tokens and their types fit, the merges after them do not.
    (GGUFLimits(max_total_array_items=2 * TOKENS + 1), rf"\d+ array items in all at key 'tokenizer\.ggml\.merges' "
                                                      rf"is over vx's limit of {2 * TOKENS + 1} "),
    (GGUFLimits(max_string_array_bytes=1000), r"bytes of strings in arrays at key 'tokenizer\.ggml\.merges' is over "
                                              r"vx's limit of 1000 \(GGUFLimits\.max_string_array_bytes\)"),
    (GGUFLimits(max_string_bytes=64), r"a string of \d+ bytes at key 'tokenizer\.chat_template' is over vx's limit "
                                      r"of 64 \(GGUFLimits\.max_string_bytes\)"),
    (GGUFLimits(max_tensor_dims=1), r"2 dimensions in tensor '\w+\.weight' is over vx's limit of 1 "),
])
def test_each_limit_refuses_naming_the_key_and_the_limit(tiny_gguf, limits, message):
    path = tiny_gguf("Q8_0").gguf_path
    assert read_gguf_header(path).array_lengths["tokenizer.ggml.tokens"] == TOKENS
    with pytest.raises(ValueError, match=message):
        read_gguf_header(path, limits=limits)


def _hand_written(path, key: bytes, value: bytes) -> str:
    """A GGUF file of general.architecture and one more key (its name and its typed value, as bytes)."""
    def string(text: bytes) -> bytes:
        return struct.pack("<Q", len(text)) + text

    with open(path, "wb") as f:
        f.write(struct.pack("<IIQQ", GGUF_MAGIC, 3, 0, 2) + string(b"general.architecture") +
                struct.pack("<I", GGUFValueType.STRING) + string(b"llama") + string(key) + value)
    return str(path)


def test_arrays_nested_too_deep_and_lengths_past_the_end_are_refused(tmp_path):
    array, string = GGUFValueType.ARRAY, GGUFValueType.STRING
    deep = _hand_written(tmp_path / "deep.gguf", b"x", struct.pack("<IIQIQIQ", array, array, 1, array, 1, array, 0))
    with pytest.raises(ValueError, match=r"arrays nested 3 deep at key 'x' is over vx's limit of 2"):
        read_gguf_header(deep)
    long = _hand_written(tmp_path / "long.gguf", b"x", struct.pack("<IQ", string, 1 << 20) + b"short")
    with pytest.raises(ValueError, match=r"not a readable GGUF file: a string at key 'x' runs past the end"):
        read_gguf_header(long)
    items = _hand_written(tmp_path / "items.gguf", b"x", struct.pack("<IIQ", array, GGUFValueType.UINT64, 1000))
    with pytest.raises(ValueError, match=r"the array at key 'x' runs past the end of the file"):
        read_gguf_header(items)
    for length in (1 << 40, (1 << 64) - 1):  # the latter: past what a file offset can be
        strings = _hand_written(tmp_path / "strings.gguf", b"x", struct.pack("<IIQQ", array, string, 2, length))
        with pytest.raises(ValueError, match=r"not a readable GGUF file"):
            read_gguf_header(strings)
    scalars = _hand_written(tmp_path / "scalars.gguf", b"x", struct.pack("<IIQ", array, GGUFValueType.UINT64, 1 << 20))
    with pytest.raises(ValueError, match=r"the array at key 'x' runs past the end of the file"):
        read_gguf_header(scalars)
