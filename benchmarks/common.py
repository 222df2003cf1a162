"""Shared pieces of the benchmark suite: models to run, workloads, timing and a small table printer.

Models are named by a short spec (see `MODEL_CHOICES`) or given as a Hugging Face directory:

- ``default``: vx's default model (SmolLM2-135M-Instruct, run from its Q4_1 GGUF file);
- ``qwen2.5-0.5b-random``: random weights in the exact shape of Qwen2.5-0.5B (494M parameters);
- ``tiny``: a random Qwen2-shaped model (hidden 512, 8 layers), quick on a CPU;
- ``micro``: a random 2-layer model with hidden 64, for smoke tests.

Random models get the tiny byte-level BPE tokenizer of the test suite and are built once into
``$VX_CACHE_DIR/bench/<name>`` (or any folder given to `build_random_model`).
"""

from __future__ import annotations

import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_COMPLETE_MARK = ".vx-bench-complete"

MODEL_CHOICES = ("default", "qwen2.5-0.5b-random", "tiny", "micro")

# Qwen2Config keyword arguments of each random model (transformers >= 5 spells rope_theta this way).
RANDOM_MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b-random": dict(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "tiny": dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=1408, vocab_size=4096, tie_word_embeddings=False, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "micro": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=512, tie_word_embeddings=False, max_position_embeddings=2048,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


# ------------------------------------------------------------------------------------------------- models
def bench_cache_dir() -> str:
    """Where built random models are kept: `$VX_CACHE_DIR/bench`, else `~/.cache/vx/bench`."""
    from vx import envs

    return os.path.join(envs.VX_CACHE_DIR.get(), "bench")


def build_random_model(name: str, dirpath: str, seed: int = 0) -> str:
    """Save a random-weight Qwen2 model of shape `name` (a key of RANDOM_MODEL_SHAPES) with a tokenizer.

    Weights are drawn with transformers' own initialisation (normal, std 0.02) under `seed`; the big
    Qwen2.5-0.5B shape is stored in bfloat16 as the real checkpoint is, the small ones in float32.
    Returns `dirpath`. Does nothing if the folder already holds a complete build.
    """
    if name not in RANDOM_MODEL_SHAPES:
        raise ValueError(f"Unknown random model {name!r}; choose from {sorted(RANDOM_MODEL_SHAPES)}.")
    if os.path.isfile(os.path.join(dirpath, _COMPLETE_MARK)):
        return dirpath
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    # The tiny tokenizer lives with the tests; the repository root that holds `benchmarks` holds `tests` too.
    from tests.support.tiny_tokenizer import make_tiny_tokenizer

    config = Qwen2Config(**RANDOM_MODEL_SHAPES[name], bos_token_id=0, eos_token_id=0, pad_token_id=0,
                         use_sliding_window=False, initializer_range=0.02)
    store_dtype = torch.bfloat16 if config.vocab_size > 100_000 else torch.float32
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=store_dtype)
    os.makedirs(dirpath, exist_ok=True)
    model.save_pretrained(dirpath)
    del model
    make_tiny_tokenizer(dirpath)
    open(os.path.join(dirpath, _COMPLETE_MARK), "w").close()
    return dirpath


def resolve_bench_model(spec: str | None) -> str:
    """A model directory for `spec`: one of MODEL_CHOICES (built once, or the default model's config directory) or a directory."""
    if spec is None or spec == "default":
        from vx.config.model_source import resolve_model

        return resolve_model(None)
    if spec in RANDOM_MODEL_SHAPES:
        target = os.path.join(bench_cache_dir(), spec)
        if not os.path.isfile(os.path.join(target, _COMPLETE_MARK)):
            print(f"building random model {spec!r} in {target} (once)...", file=sys.stderr, flush=True)
        return build_random_model(spec, target)
    path = os.path.abspath(os.path.expanduser(spec))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SystemExit(f"--model {spec!r}: not one of {', '.join(MODEL_CHOICES)} and not a model directory.")
    return path


def resolve_gguf_or_dir(spec: str | None) -> tuple[str | None, str]:
    """The GGUF file (None for a Hugging Face directory) and the model directory (config, tokenizer) of `spec`:
    None or ``default`` (the default model's GGUF file), a ``.gguf`` path, or what `resolve_bench_model` takes."""
    from vx.config.model_source import default_model_file, ensure_gguf_config

    if spec in (None, "default"):
        gguf = default_model_file()
    elif spec.endswith(".gguf"):
        gguf = os.path.abspath(os.path.expanduser(spec))
    else:
        return None, resolve_bench_model(spec)
    return gguf, ensure_gguf_config(gguf)


def load_hf_causal_lm(model_dir: str, dtype: str) -> Any:
    """Hugging Face's model for a vx model directory: from the GGUF file it points at (transformers dequantizes
    it), or from the directory's own weights."""
    import json

    from transformers import AutoModelForCausalLM

    with open(os.path.join(model_dir, "config.json")) as f:
        quant = json.load(f).get("quantization_config") or {}
    if quant.get("quant_method") == "gguf":
        folder, name = os.path.split(quant["gguf_file"])
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch_dtype(dtype))
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(dtype))


def model_label(spec: str | None, path: str) -> str:
    """A short name for tables: the spec when it is a named model, else the folder's name."""
    return spec if spec in MODEL_CHOICES else os.path.basename(os.path.normpath(path))


def prompt_token_range(model_dir: str) -> tuple[int, int]:
    """[lo, hi) of token ids safe for random prompts: below both the model's and the tokenizer's vocab,
    above the low ids where tokenizers keep their special tokens."""
    from transformers import AutoConfig, AutoTokenizer

    vocab = int(AutoConfig.from_pretrained(model_dir).vocab_size)
    hi = min(vocab, len(AutoTokenizer.from_pretrained(model_dir)))
    lo = min(100, hi // 4)
    return lo, hi


def default_device() -> str:
    """`cuda` when available, else `cpu`."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_dtype(name: str) -> Any:
    """The torch dtype named `name` (float32, bfloat16, float16)."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


# ---------------------------------------------------------------------------------------------- workloads
@dataclass
class Workload:
    """Requests given as token ids, each with the exact number of tokens it must generate."""

    prompts: list[list[int]]
    output_lens: list[int]

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def subset(self, n: int) -> "Workload":
        return Workload(self.prompts[:n], self.output_lens[:n])

    def describe(self) -> str:
        pl = [len(p) for p in self.prompts]
        return (f"{len(self)} requests, prompt {min(pl)}-{max(pl)} tokens (mean {statistics.mean(pl):.0f}), "
                f"output {min(self.output_lens)}-{max(self.output_lens)} tokens "
                f"(mean {statistics.mean(self.output_lens):.0f})")


def make_workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                  token_range: tuple[int, int], seed: int = 0) -> Workload:
    """Seeded random requests: lengths uniform in the inclusive ranges, token ids uniform in [lo, hi)."""
    if num_requests < 1:
        raise ValueError("num_requests must be >= 1")
    rng = random.Random(seed)
    lo, hi = token_range
    prompts, outs = [], []
    for _ in range(num_requests):
        n = rng.randint(*prompt_len)
        prompts.append([rng.randrange(lo, hi) for _ in range(n)])
        outs.append(rng.randint(*output_len))
    return Workload(prompts, outs)


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (seconds from 0) of a Poisson process of `rate` requests/s; inf rate: all at 0."""
    if math.isinf(rate) or rate <= 0:
        return [0.0] * num_requests
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(num_requests):
        times.append(t)
        t += rng.expovariate(rate)
    return times


# ------------------------------------------------------------------------------------------------- timing
def measure(fn: Callable[[], Any], min_time: float = 0.2, min_reps: int = 3, max_reps: int = 10_000,
            warmup: int = 1, sync: Callable[[], None] | None = None) -> list[float]:
    """Run `fn` `warmup` times, then repeatedly until `min_time` seconds and `min_reps` runs have passed;
    returns the per-call times in seconds. `sync` (e.g. torch.cuda.synchronize) runs after each call."""
    for _ in range(warmup):
        fn()
        if sync:
            sync()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < min_time):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return times


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation; nan for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ratio(a: float, b: float) -> str:
    """`a / b` as '1.23x' ('n/a' when undefined)."""
    if not b or math.isnan(a) or math.isnan(b):
        return "n/a"
    return f"{a / b:.2f}x"


def median_spread(values: Sequence[float], scale: float = 1.0) -> tuple[float, str]:
    """The median of `values` times `scale`, and their spread as 'min-max' (3 significant digits, whole numbers
    from 100 up)."""

    def short(v: float) -> str:
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"

    med = statistics.median(values) * scale
    return med, f"{short(min(values) * scale)}-{short(max(values) * scale)}"


# ------------------------------------------------------------------------------------------------ machine
def machine_description() -> str:
    """The CPU for a table's note: its model name, core count and the vector/matrix units that matter here."""
    from vx import platform

    flags = platform.cpu_flags()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags]
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{model or 'CPU'}, {os.cpu_count()} cores, {'/'.join(isa) or 'no AVX2'}"


def rss_bytes() -> int:
    """This process's resident memory."""
    import psutil

    return psutil.Process().memory_info().rss


def select_engines(spec: str, choices: Sequence[str], gguf: str | None) -> tuple[list[str], list[str]]:
    """The engines a comma-separated `--engines` names (from `choices`), and the notes on those skipped: llama.cpp
    when llama-cpp-python is not installed or the model is not a GGUF file."""
    import importlib.util

    names = [e.strip() for e in spec.split(",") if e.strip()]
    unknown = set(names) - set(choices)
    if unknown:
        raise SystemExit(f"unknown engine(s) {', '.join(sorted(unknown))}; choose from {', '.join(choices)}")
    skipped = []
    if "llama.cpp" in names and importlib.util.find_spec("llama_cpp") is None:
        skipped.append("llama.cpp skipped: llama-cpp-python is not installed (pip install 'vx[bench]')")
    elif "llama.cpp" in names and gguf is None:
        skipped.append("llama.cpp skipped: the model is not a GGUF file")
    if skipped:
        names.remove("llama.cpp")
    return names, skipped


def engine_model_runner(llm_engine: Any) -> Any:
    """The ModelRunner of an `LLMEngine` whose engine core runs in this process (`vx.LLM(...).llm_engine`)."""
    return llm_engine.engine_core.engine_core.executor.worker.model_runner


def run_child(module: str, argv: list[str], threads: int | None = None) -> dict | str:
    """Run `python -m module *argv` in a fresh process (OMP_NUM_THREADS=threads when given) and return the dict it
    prints on a `RESULT <json>` line, or 'failed: ...' with the tail of its output."""
    import json

    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    if proc.returncode < 0:  # killed by a signal, often with nothing printed (a crash in a native library)
        tail.append(f"killed by {signal.Signals(-proc.returncode).name}")
    return "failed: " + " / ".join(tail or [f"exit status {proc.returncode}"])


def interleaved_rounds(names: Sequence[str], rounds: int,
                       run_one: Callable[[str, int], dict | str]) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """Run every name once per round, the names taking turns (`run_one(name, round)`: a result dict, or a string
    saying why it failed): each name's results, and the last failure of each name that failed."""
    results: dict[str, list[dict]] = {name: [] for name in names}
    failures: dict[str, str] = {}
    for r in range(rounds):
        for name in names:
            print(f"round {r + 1}/{rounds}: {name} ...", file=sys.stderr, flush=True)
            got = run_one(name, r)
            if isinstance(got, str):
                failures[name] = got
            else:
                results[name].append(got)
    return results, failures


# ------------------------------------------------------------------------------------------------- tables
@dataclass
class Table:
    """A titled table printed as markdown (pipe) rows, so that run_all's report reads as markdown."""

    title: str
    headers: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        self.rows.append(list(cells))

    def render(self) -> str:
        cells = [[_fmt(c) for c in row] for row in self.rows]
        ncol = len(self.headers)
        widths = [max([len(h)] + [len(r[i]) for r in cells if i < len(r)]) for i, h in enumerate(self.headers)]
        # numbers right-aligned, text (and the first column) left-aligned
        numeric = [i > 0 and all(_NUMBER_LIKE.match(r[i]) for r in cells if i < len(r)) for i in range(ncol)]

        def line(items: Sequence[str]) -> str:
            return "| " + " | ".join(s.rjust(w) if num else s.ljust(w)
                                     for s, w, num in zip(items, widths, numeric)) + " |"

        out = [f"### {self.title}", "", line(self.headers),
               "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2))
                              for w, num in zip(widths, numeric)) + "|"]
        out += [line(r + [""] * (ncol - len(r))) for r in cells]
        out += [""] + list(self.notes)
        return "\n".join(out).rstrip() + "\n"

    def print(self) -> None:
        print(self.render(), flush=True)


_NUMBER_LIKE = re.compile(r"^([-+]?[\d,]*\.?\d+(e[-+]?\d+)?[x%]?|n/a|-)$")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if v == 0:
            return "0"
        a = abs(v)
        if a >= 100:
            return f"{v:,.0f}"
        if a >= 10:
            return f"{v:.1f}"
        if a >= 0.01:
            return f"{v:.2f}"
        return f"{v:.2e}"
    return str(v)


def parse_int_list(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (argparse type)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from e
    if not values or any(v < 1 for v in values):
        raise ValueError(f"expected positive integers, got {text!r}")
    return values


def add_model_args(ap: Any, default_model: str = "default", default_dtype: str = "float32") -> None:
    """The options every model-running benchmark shares: --model, --dtype, --device, --seed. `--dtype auto` is
    vx's own choice for the device (`resolve_bench_dtype`)."""
    ap.add_argument("--model", default=default_model,
                    help=f"one of {', '.join(MODEL_CHOICES)}, or a Hugging Face model directory "
                         f"(default: {default_model})")
    ap.add_argument("--dtype", default=default_dtype, choices=["auto", "float32", "bfloat16", "float16"],
                    help=f"(default: {default_dtype}; auto: vx's choice for the device, bfloat16 on a CPU with AMX "
                         "or AVX512-BF16, else float32)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads, here and in engine processes (default: torch's choice)")


def resolve_bench_dtype(dtype: str, device: str) -> str:
    """`auto` -> the dtype vx's `dtype="auto"` picks on `device` (for every engine of the run, HF's included)."""
    from vx.platform import resolve_dtype

    return resolve_dtype(dtype, device, None)


def resolve_device(device: str) -> str:
    """`auto` -> cuda when available, else cpu."""
    return default_device() if device == "auto" else device


def set_threads(threads: int | None) -> None:
    """Pin torch's CPU thread count in this process and (through OMP_NUM_THREADS) in child processes."""
    if threads is None:
        return
    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def quiet_logs() -> None:
    """Keep tokenizer fork warnings and transformers' chatter out of benchmark output."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
