"""Every `VX_*` environment variable vx reads, declared once and typed.

A variable is read when asked (`envs.VX_CACHE_DIR.get()`), never at import, so a test can monkeypatch the
environment. Unset and empty mean the same: the default. docs/configuration.md lists exactly these, and a
test holds the two together.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One environment variable: its name, its default (as written in the environment), how it parses, why."""

    name: str
    default: str
    parse: Callable[[str], T]
    meaning: str

    def get(self) -> T:
        """The variable's value now: the environment as it is at this call, parsed; its default when unset."""
        return self.parse(os.environ.get(self.name) or self.default)


def _path(value: str) -> str:
    return os.path.abspath(os.path.expanduser(value))


def _switch(value: str) -> bool:
    return value != "0"


def _optional(value: str) -> str | None:
    return value or None


VX_CACHE_DIR: EnvVar[str] = EnvVar(
    "VX_CACHE_DIR", "~/.cache/vx", _path,
    "where vx keeps what it builds once: a GGUF file's config and tokenizer (`gguf-config/`; the weights stay in "
    "the file), a config.json's fields as transformers resolves them (`hf-config/`, so the engine process need not "
    "import transformers), compiled CPU kernels (`kernels/`) and AOT-compiled CPU decode graphs (`decode-graphs/`; "
    "a key no engine used for 30 days is removed at the next compile)")

VX_CPU_KERNELS: EnvVar[bool] = EnvVar(
    "VX_CPU_KERNELS", "1", _switch,
    "`0` keeps vx's C kernels off: the `cpu` attention backend is then unavailable and `auto` takes `torch`; "
    "quantized weights multiply through torch's slower ops")

VX_PROGRESS: EnvVar[bool] = EnvVar(
    "VX_PROGRESS", "1", _switch,
    "`0` keeps the engine process quiet about what a first start builds (vx's C kernels for this CPU, a model's "
    "decode graph): by default it says so on stderr, with an estimate, and again when done")

def _one_of(name: str, *choices: str) -> Callable[[str], str]:
    """A parser that accepts only `choices` (the variable's value as given)."""
    def parse(value: str) -> str:
        if value not in choices:
            raise ValueError(f"{name} must be {', '.join(choices[:-1])} or {choices[-1]}, not {value!r}.")
        return value
    return parse


VX_CPU_MATMUL: EnvVar[str] = EnvVar(
    "VX_CPU_MATMUL", "auto", _one_of("VX_CPU_MATMUL", "auto", "float", "int8"),
    "how vx's C kernel multiplies quantized weights on the CPU, chosen when a weight is loaded: `float` (float32 "
    "activations times the dequantized weight: exact up to float rounding), `int8` (activations rounded to int8 "
    "per group of the weight, integer dot products: faster, each element off by at most half a step of its group, "
    "1/254 of the group's largest magnitude; llama.cpp's GGUF path rounds the same way; GGUF's quantized weights "
    "(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_XS, Q4_K, Q5_K, Q6_K) are then read as stored, x rounded per block of 32 "
    "or 256, except Q4_0/Q4_1/Q8_0 weights under 1 MiB, repacked into as many bits) or `auto` (int8 where the CPU has VNNI dot products, float elsewhere; on a CPU with AMX, a bf16 model's products of 32 rows or more multiply on bf16 "
    "tiles instead: the weight dequantized to bf16 per call)")

VX_DECODE_COMPILE: EnvVar[str] = EnvVar(
    "VX_DECODE_COMPILE", "background", _one_of("VX_DECODE_COMPILE", "background", "startup", "off"),
    "when the decode graphs are built: `background` (the CPU's compiled graphs, one batch size at a time while "
    "eager steps serve: size 1 at start-up, others when first needed; CUDA graphs are always captured at start-up), "
    "`startup` (all of them before the engine serves) or `off` (never: every step eager, as `enforce_eager=True`)")

VX_DECODE_GRAPHS: EnvVar[str] = EnvVar(
    "VX_DECODE_GRAPHS", "aoti", _one_of("VX_DECODE_GRAPHS", "aoti", "inductor"),
    "how the CPU's decode graphs are compiled: `aoti` (AOTInductor, in a child process, cached in "
    "`$VX_CACHE_DIR/decode-graphs/`; the engine loads the packages without importing the compiler, and falls back "
    "to `inductor` if that fails) or `inductor` (torch.compile in the engine process)")

VX_API_KEY: EnvVar[str | None] = EnvVar(
    "VX_API_KEY", "", _optional,
    "the key `vx serve` requires as `Authorization: Bearer KEY` on /v1/* when `--api-key` is not given")
