"""Where a GGUF file's tensors lie: its header read without materializing the metadata values, within limits.

`gguf.GGUFReader` turns every metadata value into numpy objects (two per vocabulary entry: ~200k for a 49k-token
vocabulary), and what they leave in the heap stayed in the engine's memory: 18 MiB of the default model's run
(measured: the same load with and without the reader's parse). The engine needs only the architecture, the
alignment and the tensor infos, so this reads those and steps over everything else. The config and tokenizer are
read with the gguf package (through transformers), in the child process that writes the model's config directory.

A header can claim what no real model has: millions of (even empty) strings cost 8 bytes each in the file but a
Python object each once a reader materializes them. So every count and length is checked against `GGUFLimits`
before it is stepped over, and a file over one is refused naming the key and the limit; a file this reader accepts
is safe for the gguf package to parse. torch-free (unlike `vx.models`): the front end checks a file before any child
process parses it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import NamedTuple

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

# Byte sizes of the fixed-size value types, and their struct formats.
_SCALAR_FORMATS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
                   GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
                   GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
                   GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
_SCALAR_SIZES = {t: struct.calcsize(f) for t, f in _SCALAR_FORMATS.items()}


_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFLimits:
    """The most a GGUF header may hold. Real files stay well below: a few dozen keys, vocabularies of up to ~262k
    tokens, each with a score and a type, plus up to ~450k merges (~850k array items in all), chat templates of tens
    of KiB, a few thousand tensors of at most 4 dims. The gguf package's reader, which transformers uses to write a
    file's config directory, holds ~0.7 KiB per number and ~1.3 KiB per string of an array (measured), so the
    total of array items bounds what a file within these limits costs it: ~2.7 GiB at most."""

    max_keys: int = 1 << 16
    max_string_bytes: int = 1 << 24  # one string: a key, a value or a tensor name (array items: the total below)
    max_array_items: int = 1 << 20  # one array (nested arrays' items count towards their outer array)
    max_total_array_items: int = 1 << 21  # all the file's arrays
    max_array_depth: int = 2  # an array of arrays, no deeper
    max_string_array_bytes: int = 1 << 28  # the bytes of all the strings in the file's arrays
    max_tensors: int = 1 << 16
    max_tensor_dims: int = 4  # GGML_MAX_DIMS


DEFAULT_LIMITS = GGUFLimits()


class OverLimitError(ValueError):
    """A header value over a `GGUFLimits` bound (message: the key, the value and the limit)."""


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
    array_lengths: dict[str, int]  # every top-level array's item count, by key (the vocabulary's size among them)


class _Cursor:
    """Little-endian reads from a buffer, advancing; every count and length checked against the limits."""

    def __init__(self, buf: mmap.mmap, limits: GGUFLimits) -> None:
        self.buf, self.pos, self.limits = buf, 0, limits
        self.where = ""  # what is being read ("at key ..."), for the messages
        self.array_items = self.string_array_bytes = 0

    def over(self, what: str, limit_name: str) -> OverLimitError:
        """The error for `what` (a count or length, with its value) going over the limit `limit_name`."""
        where = f" {self.where}" if self.where else ""
        return OverLimitError(f"{what}{where} is over vx's limit of {getattr(self.limits, limit_name)} "
                              f"(GGUFLimits.{limit_name})")

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        self._check_string(length)
        value = self.buf[self.pos:self.pos + length].decode("utf-8")
        self.pos += length
        return value

    def skip_string(self) -> None:
        (length,) = self.unpack("Q")
        self._check_string(length)
        self.pos += length

    def _check_string(self, length: int) -> None:
        if length > self.limits.max_string_bytes:
            raise self.over(f"a string of {length} bytes", "max_string_bytes")
        if self.pos + length > len(self.buf):
            raise ValueError(f"a string {self.where} runs past the end of the file")

    def value(self, value_type: int, keep: bool) -> object:
        """A string or scalar metadata value: returned when `keep`, else stepped over."""
        if value_type == GGUFValueType.STRING:
            if keep:
                return self.string()
            self.skip_string()
            return None
        if value_type not in _SCALAR_SIZES:
            raise ValueError(f"unknown metadata value type {value_type} {self.where}")
        value_type = GGUFValueType(value_type)
        value = struct.unpack_from("<" + _SCALAR_FORMATS[value_type], self.buf, self.pos)[0] if keep else None
        self.pos += _SCALAR_SIZES[value_type]
        return value

    def skip_array(self, depth: int) -> int:
        """Step over an array; its item count. The counts are checked before anything is stepped over."""
        if depth > self.limits.max_array_depth:
            raise self.over(f"arrays nested {depth} deep", "max_array_depth")
        item_type, count = self.unpack("IQ")
        if count > self.limits.max_array_items:
            raise self.over(f"an array of {count} items", "max_array_items")
        self.array_items += count
        if self.array_items > self.limits.max_total_array_items:
            raise self.over(f"{self.array_items} array items in all", "max_total_array_items")
        if item_type in _SCALAR_SIZES:
            self.pos += _SCALAR_SIZES[GGUFValueType(item_type)] * count
            if self.pos > len(self.buf):
                raise ValueError(f"the array {self.where} runs past the end of the file")
        elif item_type == GGUFValueType.STRING:
            # A vocabulary: the one long loop, kept tight; the bytes it stepped over are checked after it (an item
            # longer than the file makes the next read, or that check, fail).
            start, pos, length_at = self.pos, self.pos, _U64.unpack_from
            for _ in range(count):
                pos += 8 + length_at(self.buf, pos)[0]
            if pos > len(self.buf):
                raise ValueError(f"the strings {self.where} run past the end of the file")
            self.string_array_bytes += pos - start - 8 * count
            if self.string_array_bytes > self.limits.max_string_array_bytes:
                raise self.over(f"{self.string_array_bytes} bytes of strings in arrays", "max_string_array_bytes")
            self.pos = pos
        elif item_type == GGUFValueType.ARRAY:
            items = 0
            for _ in range(count):
                items += self.skip_array(depth + 1)
                if items > self.limits.max_array_items:
                    raise self.over(f"an array of {items} items", "max_array_items")
        else:
            raise ValueError(f"unknown metadata value type {item_type} {self.where}")
        return count


def read_gguf_header(path: str, key_prefix: str | None = None, limits: GGUFLimits = DEFAULT_LIMITS) -> GGUFHeader:
    """The architecture and tensor infos of a GGUF file (version 2 or 3, little-endian), and the values of the keys
    starting with `key_prefix` if given (e.g. "gemma2."); `ValueError` if it is not one, or if it holds more than
    `limits` allow (naming the key and the limit)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _read(buf, key_prefix, limits)
    except OverLimitError as e:
        raise OverLimitError(f"GGUF file {path!r} is refused: {e}.") from None
    except (OSError, struct.error, UnicodeDecodeError, ValueError, OverflowError) as e:  # overflow: a length of 2**63+
        raise ValueError(f"{path!r} is not a readable GGUF file: {e}") from e


def _read(buf: mmap.mmap, key_prefix: str | None, limits: GGUFLimits) -> GGUFHeader:
    cur = _Cursor(buf, limits)
    magic, version = cur.unpack("II")
    if magic != GGUF_MAGIC:
        raise ValueError("no GGUF magic number")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (vx reads versions 2 and 3, little-endian)")
    tensor_count, kv_count = cur.unpack("QQ")
    if kv_count > limits.max_keys:
        raise cur.over(f"{kv_count} keys", "max_keys")
    if tensor_count > limits.max_tensors:
        raise cur.over(f"{tensor_count} tensors", "max_tensors")
    architecture, alignment = None, GGUF_DEFAULT_ALIGNMENT
    metadata: dict[str, object] = {}
    array_lengths: dict[str, int] = {}
    for index in range(kv_count):
        cur.where = f"in the name of key #{index}"
        key = cur.string()
        cur.where = f"at key {key!r}"
        (value_type,) = cur.unpack("I")
        if value_type == GGUFValueType.ARRAY:
            array_lengths[key] = cur.skip_array(1)
            continue
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
    if alignment <= 0:
        raise ValueError(f"general.alignment is {alignment}")
    infos = []
    for index in range(tensor_count):
        cur.where = f"in the name of tensor #{index}"
        name = cur.string()
        cur.where = f"in tensor {name!r}"
        (n_dims,) = cur.unpack("I")
        if n_dims > limits.max_tensor_dims:
            raise cur.over(f"{n_dims} dimensions", "max_tensor_dims")
        dims = cur.unpack(f"{n_dims}Q")
        ggml_type, offset = cur.unpack("IQ")
        infos.append((name, ggml_type, dims, offset))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = [TensorInfo(name, ggml_type, tuple(dims), data_start + offset) for name, ggml_type, dims, offset in infos]
    for t in tensors:
        if t.ggml_type in GGML_QUANT_SIZES and t.offset + t.nbytes > len(buf):
            raise ValueError(f"tensor {t.name!r} runs past the end of the file (truncated?)")
    return GGUFHeader(architecture, tensors, metadata, array_lengths)
