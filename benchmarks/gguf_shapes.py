"""Real-shape GGUF files with random weights, for benchmarks only (their tokens are noise: never a quality check).

    python -m benchmarks.gguf_shapes 1.7b            # writes (once) and prints the file's path
    python -m benchmarks.gguf_shapes 8b --seed 1

A named shape (`SHAPES`) becomes a Llama-architecture GGUF file in llama.cpp's Q4_K_M mix: the token embedding in
Q4_K (in Q6_K when the output head is tied to it), the output head in Q6_K, attn_v and ffn_down in Q6_K in the layers
where Q4_K_M spends more bits (the first and last eighth, and every third in between) and in Q4_K elsewhere, every
other matrix in Q4_K, the norms in F32. The blocks are random bytes with small finite float16 scales (valid data:
weights of a few hundredths, as trained models have). The file carries the default model's tokenizer and chat
template, so every shape's vocabulary is the default model's 49152 tokens (Llama-3-8B has 128256: the "8b" shape
has its layers, and a smaller embedding and head).

Files are written tensor by tensor (memory holds one tensor at a time) into the bench cache folder
(`benchmarks.common.bench_cache_dir`), keyed by shape and seed, and reused.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Iterator

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import bench_cache_dir

# The writer's output changes with this: files of another form are written anew under another name.
_FORMAT = 1
_Q4_K, _Q6_K, _F32 = 12, 14, 0
_BLOCK = {_Q4_K: (256, 144), _Q6_K: (256, 210)}  # weights per block, bytes per block
# Where each type keeps its float16 scales, and their typical size: Q4_K's d and dmin, Q6_K's d. Q4_K weights are
# d * sc * q - dmin * m (6-bit sc and m, 4-bit q), Q6_K's d * sc * (q - 32) (8-bit signed sc, 6-bit q).
_F16_SCALES = {_Q4_K: ((0, 3e-5), (2, 2e-4)), _Q6_K: ((208, 5e-6),)}
_FILE_TYPE_Q4_K_M = 15  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M


@dataclass(frozen=True)
class ModelShape:
    """A Llama-architecture model's dimensions."""

    label: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool
    rope_theta: float
    vocab: int = 49152  # the default model's tokenizer
    context: int = 8192
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def parameters(self) -> int:
        """Weights in all, the embedding counted once when the head is tied to it."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        per_layer = attn + 3 * self.hidden * self.ffn + 2 * self.hidden
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape("tiny (for tests)", hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, tied=True,
                       rope_theta=10000.0),
    "1.7b": ModelShape("SmolLM2-1.7B", hidden=2048, layers=24, heads=32, kv_heads=32, ffn=8192, tied=True,
                       rope_theta=130000.0),
    "8b": ModelShape("Llama-3-8B (vocabulary 49152)", hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336,
                     tied=False, rope_theta=500000.0),
}


def random_blocks(ggml_type: int, rows: int, features: int, rng: np.random.Generator) -> np.ndarray:
    """`rows` rows of random `ggml_type` (Q4_K or Q6_K) blocks covering `features` weights each, uint8
    [rows, row bytes]: random bytes with float16 scales drawn around `_F16_SCALES`' sizes (0.5x to 1.5x)."""
    block, size = _BLOCK[ggml_type]
    n_blocks = rows * features // block
    raw = np.frombuffer(bytearray(rng.bytes(n_blocks * size)), dtype=np.uint8).reshape(n_blocks, size)
    for at, typical in _F16_SCALES[ggml_type]:
        scales = (typical * (0.5 + rng.random(n_blocks, dtype=np.float32))).astype(np.float16)
        raw[:, at:at + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(rows, features // block * size)


def _more_bits(layer: int, layers: int) -> bool:
    """Whether Q4_K_M gives a layer's attn_v and ffn_down Q6_K: the first and last eighth of the layers and every
    third layer in between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_plan(shape: ModelShape) -> Iterator[tuple[str, tuple[int, ...], int]]:
    """(name, numpy shape [out, in] or [n], GGML type) of every tensor of the file, in file order."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    yield "token_embd.weight", (shape.vocab, h), _Q6_K if shape.tied else _Q4_K
    for i in range(shape.layers):
        wide = _Q6_K if _more_bits(i, shape.layers) else _Q4_K
        yield f"blk.{i}.attn_norm.weight", (h,), _F32
        yield f"blk.{i}.attn_q.weight", (shape.heads * shape.head_dim, h), _Q4_K
        yield f"blk.{i}.attn_k.weight", (kv, h), _Q4_K
        yield f"blk.{i}.attn_v.weight", (kv, h), wide
        yield f"blk.{i}.attn_output.weight", (h, shape.heads * shape.head_dim), _Q4_K
        yield f"blk.{i}.ffn_norm.weight", (h,), _F32
        yield f"blk.{i}.ffn_gate.weight", (shape.ffn, h), _Q4_K
        yield f"blk.{i}.ffn_up.weight", (shape.ffn, h), _Q4_K
        yield f"blk.{i}.ffn_down.weight", (h, shape.ffn), wide
    yield "output_norm.weight", (h,), _F32
    if not shape.tied:
        yield "output.weight", (shape.vocab, h), _Q6_K


def _nbytes(dims: tuple[int, ...], ggml_type: int) -> int:
    if ggml_type == _F32:
        return 4 * int(np.prod(dims))
    block, size = _BLOCK[ggml_type]
    return dims[0] * dims[1] // block * size


def tokenizer_metadata() -> list[tuple[str, object, object, object]]:
    """(key, value, type, array item type) of the default model's `tokenizer.*` keys (its vocabulary, merges,
    special tokens and chat template), as the gguf package reads them."""
    from gguf import GGUFReader, GGUFValueType

    from vx.config.model_source import default_model_file

    out = []
    for field in GGUFReader(default_model_file()).fields.values():
        if field.name.startswith("tokenizer."):
            main = field.types[0]
            out.append((field.name, field.contents(), main, field.types[-1] if main == GGUFValueType.ARRAY else None))
    return out


def write_random_gguf(shape: ModelShape, path: str, seed: int = 0) -> None:
    """Write `shape` with random Q4_K_M weights (see the module) to `path`, one tensor in memory at a time."""
    from gguf import GGUFWriter

    tokenizer = tokenizer_metadata()
    vocab = next(len(value) for key, value, _, _ in tokenizer if key == "tokenizer.ggml.tokens")
    if vocab != shape.vocab:
        raise ValueError(f"the default tokenizer has {vocab} tokens, the shape {shape.vocab}")
    writer = GGUFWriter(path, "llama")
    writer.add_name(f"random {shape.label}")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type(_FILE_TYPE_Q4_K_M)
    writer.add_quantization_version(2)
    for key, value, value_type, item_type in tokenizer:
        writer.add_key_value(key, value, value_type, sub_type=item_type)
    plan = list(tensor_plan(shape))
    for name, dims, ggml_type in plan:
        if ggml_type == _F32:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), _nbytes(dims, ggml_type))
        else:
            byte_dims = (dims[0], _nbytes(dims, ggml_type) // dims[0])
            writer.add_tensor_info(name, byte_dims, np.dtype(np.uint8), _nbytes(dims, ggml_type), raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, ggml_type in plan:
        if ggml_type == _F32:
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:
            writer.write_tensor_data(random_blocks(ggml_type, dims[0], dims[1], rng))
    writer.close()


def shape_file_path(name: str, seed: int = 0) -> str:
    """Where the file of shape `name` and `seed` lies in the bench cache (written or not)."""
    return os.path.join(bench_cache_dir(), "gguf-shapes", f"{name}-q4_k_m-seed{seed}-v{_FORMAT}.gguf")


def random_gguf(name: str, seed: int = 0) -> str:
    """The path of shape `name`'s random Q4_K_M file (a key of SHAPES), written first if the cache lacks it."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    path = shape_file_path(name, seed)
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = f"{path}.{os.getpid()}.partial"
        print(f"writing random {SHAPES[name].label} GGUF to {path} (once)...", file=sys.stderr, flush=True)
        try:
            write_random_gguf(SHAPES[name], partial, seed)
            os.replace(partial, path)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gguf_shapes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=list(SHAPES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    path = random_gguf(args.shape, args.seed)
    print(f"{path} ({os.path.getsize(path) / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
