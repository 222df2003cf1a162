"""Where a GGUF file's tensors lie: its header read without materializing the metadata values.

`gguf.GGUFReader` turns every metadata value into numpy objects (two per vocabulary entry: ~200k for a 49k-token
vocabulary), and what they leave in the heap stayed in the engine's memory: 18 MiB of the default model's run
(measured: the same load with and without the reader's parse). The engine needs only the architecture, the
alignment and the tensor infos, so this reads those and steps over everything else. The config and tokenizer are
read with the gguf package (through transformers), in the child process that writes the model's config directory.
"""

from __future__ import annotations

import mmap
import struct
from typing import NamedTuple

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

# Byte sizes of the fixed-size value types, and their struct formats.
_SCALAR_FORMATS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
                   GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
                   GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
                   GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
_SCALAR_SIZES = {t: struct.calcsize(f) for t, f in _SCALAR_FORMATS.items()}


_U64 = struct.Struct("<Q")


class TensorInfo(NamedTuple):
    """One tensor of a GGUF file."""

    name: str
    ggml_type: int
    dims: tuple[int, ...]  # GGML's order: the row length first
    offset: int  # of its first byte in the file

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        count = 1
        for d in self.dims:
            count *= d
        return count // block * size


class GGUFHeader(NamedTuple):
    """What the engine needs of a GGUF file's header."""

    architecture: str
    tensors: list[TensorInfo]
    metadata: dict[str, object]  # the scalar and string values under the keys asked for (arrays are skipped)


class _Cursor:
    """Little-endian reads from a buffer, advancing."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        value = self.buf[self.pos:self.pos + length].decode("utf-8")
        self.pos += length
        return value

    def skip_string(self) -> None:
        (length,) = self.unpack("Q")
        self.pos += length

    def value(self, value_type: int, keep: bool) -> object:
        """A metadata value: returned when `keep` (strings and scalars), else stepped over."""
        if value_type == GGUFValueType.STRING:
            if keep:
                return self.string()
            self.skip_string()
            return None
        if value_type == GGUFValueType.ARRAY:
            item_type, count = self.unpack("IQ")
            if item_type in _SCALAR_SIZES:
                self.pos += _SCALAR_SIZES[GGUFValueType(item_type)] * count
            elif item_type == GGUFValueType.STRING:  # a vocabulary: the one long loop, kept tight
                pos, length_at = self.pos, _U64.unpack_from
                for _ in range(count):
                    pos += 8 + length_at(self.buf, pos)[0]
                self.pos = pos
            else:
                for _ in range(count):
                    self.value(item_type, keep=False)
            return None
        if value_type not in _SCALAR_SIZES:
            raise ValueError(f"unknown metadata value type {value_type}")
        value_type = GGUFValueType(value_type)
        value = struct.unpack_from("<" + _SCALAR_FORMATS[value_type], self.buf, self.pos)[0] if keep else None
        self.pos += _SCALAR_SIZES[value_type]
        return value


def read_gguf_header(path: str, key_prefix: str | None = None) -> GGUFHeader:
    """The architecture and tensor infos of a GGUF file (version 2 or 3, little-endian), and the values of the keys
    starting with `key_prefix` if given (e.g. "gemma2."); `ValueError` if it is not one."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _read(buf, path, key_prefix)
    except (OSError, struct.error, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path!r} is not a readable GGUF file: {e}") from e


def _read(buf: mmap.mmap, path: str, key_prefix: str | None) -> GGUFHeader:
    cur = _Cursor(buf)
    magic, version = cur.unpack("II")
    if magic != GGUF_MAGIC:
        raise ValueError("no GGUF magic number")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (vx reads versions 2 and 3, little-endian)")
    tensor_count, kv_count = cur.unpack("QQ")
    architecture, alignment = None, GGUF_DEFAULT_ALIGNMENT
    metadata: dict[str, object] = {}
    for _ in range(kv_count):
        key = cur.string()
        (value_type,) = cur.unpack("I")
        wanted = key_prefix is not None and key.startswith(key_prefix)
        value = cur.value(value_type, keep=wanted or key in ("general.architecture", "general.alignment"))
        if wanted and value is not None:
            metadata[key] = value
        if key == "general.architecture":
            architecture = value
        elif key == "general.alignment":
            alignment = int(value)  # type: ignore[arg-type]
    if not isinstance(architecture, str):
        raise ValueError("no general.architecture")
    infos = []
    for _ in range(tensor_count):
        name = cur.string()
        (n_dims,) = cur.unpack("I")
        dims = cur.unpack(f"{n_dims}Q")
        ggml_type, offset = cur.unpack("IQ")
        infos.append((name, ggml_type, dims, offset))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = [TensorInfo(name, ggml_type, tuple(dims), data_start + offset) for name, ggml_type, dims, offset in infos]
    for t in tensors:
        if t.ggml_type in GGML_QUANT_SIZES and t.offset + t.nbytes > len(buf):
            raise ValueError(f"tensor {t.name!r} runs past the end of the file (truncated?)")
    return GGUFHeader(architecture, tensors, metadata)
