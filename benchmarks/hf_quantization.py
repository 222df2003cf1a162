"""Quantized linear layers for Hugging Face checkpoints and `quantization="int8" | "int4"`: memory, error and speed
of each layout beside the float path, on the same model in one run.

    python -m benchmarks.hf_quantization                       # the default model, float32
    python -m benchmarks.hf_quantization --rounds 5 --decode-tokens 64

Three tables:
1. Memory and error. For each layout: the bytes of the linear layers' weights, and the logits on `--prompts` real
   sentences against the float model's (relative Frobenius error, and how often the top token agrees). `int8` and
   `int4` load through the engine's own path (`quantization=`); the other rows are the alternatives the choices
   were made against, built from the float model's weights with the same kernels: int8 with groups of 32
   (`Int8Groupwise`), int4 with groups of 64 and 128, and an FP8 checkpoint (per-channel e4m3, made from the float
   weights) read either as vx reads it (dequantized: exact) or requantized to int8 per channel.
2. Matmul time of one decoder layer's four projections (qkv, o, gate_up, down) at 1 and 32 tokens, per layout,
   the variants interleaved round by round: medians and the spread (min-max) over `--rounds` rounds.
3. Batch-1 decode tokens/s and the engine process's resident memory through `vx.LLM(multiprocess=True)` for float,
   int8 and int4, interleaved over `--e2e-rounds` rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Table, add_model_args, model_label, quiet_logs, ratio, resolve_bench_model, set_threads

SENTENCES = [
    "The capital of France is Paris, and the capital of Germany is",
    "Once upon a time, in a small village by the sea, there lived",
    "To make a cup of tea, first boil the water, then",
    "The theory of relativity, proposed by Albert Einstein, states that",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "In 1969, the Apollo 11 mission landed the first humans on",
    "The quick brown fox jumps over the lazy dog. The dog",
    "Photosynthesis is the process by which green plants use sunlight to",
]


def _packed_variant(float_model: Any, build: Callable[[Any], Any]) -> Any:
    """A copy of the float model whose linear layers compute with `build(their float weight)`."""
    import copy

    from vx.models.layers.linear import LinearBase
    from vx.models.layers.quantization.packing import PackedLinearMethod

    class Prebuilt(PackedLinearMethod):
        """Computes with a packed weight built here, not loaded from a checkpoint."""

        def create_weights(self, *args: Any, **kwargs: Any) -> None:
            raise NotImplementedError

    model = copy.deepcopy(float_model)
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.quant_weight = build(module.weight.data)
            module.quant_method = Prebuilt()
            del module.weight
    return model


def _alternatives(dtype: Any) -> dict[str, Callable[[Any], Any]]:
    """Layouts measured against the shipped ones, built from a float weight with kernels.py's classes."""
    import torch

    from vx.models.layers.quantization.kernels import Int8Groupwise, Int8PerChannel
    from vx.models.layers.quantization.packing import int4_groupwise
    from vx.models.layers.quantization.weight_only import quantize_int4, quantize_int8

    def int8_group32(w: torch.Tensor) -> Any:
        n, k = w.shape
        groups = w.float().reshape(n, k // 32, 32)
        scale = groups.abs().amax(-1) / 127
        q = (groups / scale.clamp(min=1e-12)[..., None]).round().clamp(-127, 127).to(torch.int8).reshape(n, k)
        return Int8Groupwise(q, scale.to(dtype), torch.zeros_like(scale, dtype=dtype), 32)

    def int4(group: int) -> Callable[[torch.Tensor], Any]:
        def build(w: torch.Tensor) -> Any:
            g = next(size for size in (group, 64, 32) if w.shape[1] % size == 0)  # SmolLM2's 576 inputs
            q, s, z = quantize_int4(w, g)
            return int4_groupwise(q, s, z, g, dtype)
        return build

    def fp8_then_int8(w: torch.Tensor) -> Any:
        q, scale = quantize_int8(_fp8_round_trip(w))
        return Int8PerChannel(q, scale.to(dtype))

    return {"int8 (groups of 32)": int8_group32, "int4 (groups of 64)": int4(64),
            "int4 (groups of 128*)": int4(128), "fp8 -> int8 per channel": fp8_then_int8}


def _fp8_round_trip(w: Any) -> Any:
    """The weights an FP8 checkpoint with per-channel scales would hold for `w`, dequantized (what vx loads)."""
    import torch

    scale = w.float().abs().amax(dim=1, keepdim=True) / 448.0
    return ((w.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(w.dtype)


def _logits(model: Any, token_lists: list[list[int]], dtype: Any) -> list[Any]:
    from tests.support.vx_outputs import prefill_logits

    return prefill_logits(model, token_lists, dtype)


def _error(got: list[Any], ref: list[Any]) -> tuple[float, float]:
    """(relative Frobenius error, fraction of positions whose top token agrees) over all prompts."""
    diff = sum(float((g - r).pow(2).sum()) for g, r in zip(got, ref))
    norm = sum(float(r.pow(2).sum()) for r in ref)
    agree = sum(int((g.argmax(-1) == r.argmax(-1)).sum()) for g, r in zip(got, ref))
    total = sum(r.shape[0] for r in ref)
    return (diff / norm) ** 0.5, agree / total if total else float("nan")


def memory_and_error(model_dir: str, dtype: Any, token_lists: list[list[int]]) -> None:
    """Table 1."""
    from tests.support.vx_outputs import linear_weight_bytes, load_vx

    table = Table("Linear-layer weights and logits error vs the float model",
                  ["layout", "weights (MB)", "vs float", "load (s)", "rel. logits error", "top-1 agrees"])
    t0 = time.perf_counter()
    float_model = load_vx(model_dir, dtype)
    float_load = time.perf_counter() - t0
    float_bytes = linear_weight_bytes(float_model)
    ref = _logits(float_model, token_lists, dtype)
    table.add("float (the float path)", float_bytes / 1e6, "1.00x", float_load, 0.0, "100%")
    for method in ("int8", "int4"):
        t0 = time.perf_counter()
        model = load_vx(model_dir, dtype, quantization=method)
        load_s = time.perf_counter() - t0
        err, agree = _error(_logits(model, token_lists, dtype), ref)
        nbytes = linear_weight_bytes(model)
        label = {"int8": "int8 (shipped: per channel)", "int4": "int4 (shipped: groups of 32)"}[method]
        table.add(label, nbytes / 1e6, ratio(nbytes, float_bytes), load_s, err, f"{agree:.0%}")
        del model
    fp8_model = _fp8_variant(float_model)
    err, agree = _error(_logits(fp8_model, token_lists, dtype), ref)
    table.add("fp8 -> model dtype (shipped)", float_bytes / 1e6, "1.00x", "n/a", err, f"{agree:.0%}")
    for label, build in _alternatives(dtype).items():
        source = fp8_model if label.startswith("fp8") else float_model
        model = _packed_variant(source, build)
        err, agree = _error(_logits(model, token_lists, dtype), ref)
        nbytes = linear_weight_bytes(model)
        table.add(label, nbytes / 1e6, ratio(nbytes, float_bytes), "n/a", err, f"{agree:.0%}")
        del model
    table.notes.append(f"{len(token_lists)} prompts, {sum(map(len, token_lists))} positions; the fp8 rows start "
                       "from the float weights rounded to per-channel e4m3; *: groups of 64 in layers whose input "
                       "features 128 does not divide.")
    table.print()


def _fp8_variant(float_model: Any) -> Any:
    import copy

    from vx.models.layers.linear import LinearBase

    model = copy.deepcopy(float_model)
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.weight.data = _fp8_round_trip(module.weight.data)
    return model


def matmul_times(float_model: Any, dtype: Any, rounds: int) -> None:
    """Table 2: one decoder layer's projections, per layout, interleaved."""
    import torch
    import torch.nn.functional as F

    from vx.models.layers.quantization.weight_only import WeightOnlyLinearMethod

    layer = float_model.model.layers[0]
    weights = [layer.self_attn.qkv_proj.weight.data, layer.self_attn.o_proj.weight.data,
               layer.mlp.gate_up_proj.weight.data, layer.mlp.down_proj.weight.data]
    alternatives = _alternatives(dtype)
    layouts: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
        "float": [lambda x, w=w: F.linear(x, w) for w in weights]}
    for name, bits in (("int8 per channel", 8), ("int4 groups of 32", 4)):
        method = WeightOnlyLinearMethod(bits)
        layouts[name] = [method.quantize(w, dtype).matmul for w in weights]
    for name in ("int8 (groups of 32)", "int4 (groups of 128*)"):
        layouts[name.replace("(", "").replace(")", "")] = [alternatives[name](w).matmul for w in weights]
    for tokens in (1, 32):
        x = [torch.randn(tokens, w.shape[1], dtype=dtype) for w in weights]
        samples: dict[str, list[float]] = {name: [] for name in layouts}
        for _ in range(rounds):
            for name, fns in layouts.items():  # interleaved: each round times every layout once
                for fn, xi in zip(fns, x):
                    fn(xi)  # warm
                reps = 20 if tokens == 1 else 5
                t0 = time.perf_counter()
                for _ in range(reps):
                    for fn, xi in zip(fns, x):
                        fn(xi)
                samples[name].append((time.perf_counter() - t0) / reps)
        table = Table(f"One decoder layer's four projections at {tokens} token(s), {str(dtype)[6:]} activations",
                      ["layout", "median (ms)", "min (ms)", "max (ms)", "vs float"])
        base = statistics.median(samples["float"])
        for name, times in samples.items():
            med = statistics.median(times)
            table.add(name, med * 1e3, min(times) * 1e3, max(times) * 1e3, ratio(base, med))
        table.notes.append(f"{rounds} rounds, layouts interleaved within each round; 'vs float' is float time / "
                           "layout time (above 1: faster).")
        table.print()


def decode(model_dir: str, dtype: str, rounds: int, tokens: int) -> None:
    """Table 3: batch-1 decode and engine RSS through the engine, interleaved."""
    import psutil

    import vx

    samples: dict[str, list[tuple[float, float]]] = {"float": [], "int8": [], "int4": []}
    params = vx.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for _ in range(rounds):
        for name in samples:
            before = {p.pid for p in psutil.Process().children(recursive=True)}
            llm = vx.LLM(model_dir, multiprocess=True, dtype=dtype, device="cpu", num_kv_blocks=256,
                         max_model_len=1024, quantization=None if name == "float" else name)
            try:
                engine = [p for p in psutil.Process().children(recursive=True) if p.pid not in before
                          and "resource_tracker" not in " ".join(p.cmdline())]
                rss = max((p.memory_info().rss for p in engine), default=0)
                llm.generate([SENTENCES[0]], params, use_tqdm=False)  # warm
                t0 = time.perf_counter()
                llm.generate([SENTENCES[1]], params, use_tqdm=False)
                samples[name].append((tokens / (time.perf_counter() - t0), rss / 2**20))
            finally:
                llm.shutdown()
    table = Table(f"Batch-1 decode through the engine ({tokens} tokens) and engine RSS",
                  ["weights", "tok/s median", "tok/s min", "tok/s max", "vs float", "engine RSS (MiB)"])
    base = statistics.median(s[0] for s in samples["float"])
    for name, runs in samples.items():
        speeds = [s[0] for s in runs]
        table.add(name, statistics.median(speeds), min(speeds), max(speeds),
                  ratio(statistics.median(speeds), base), statistics.median(s[1] for s in runs))
    table.notes.append(f"{rounds} rounds, float/int8/int4 interleaved; RSS read once the engine is ready (same "
                       "KV cache size in each).")
    table.print()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vx bench hf_quantization", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--prompts", type=int, default=8, help=f"prompts for the error table (at most {len(SENTENCES)})")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the matmul timing")
    ap.add_argument("--e2e-rounds", type=int, default=3, help="interleaved rounds of the engine decode (0: skip)")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--tables", default="error,matmul,decode", help="which tables to make (comma-separated)")
    args = ap.parse_args(argv)
    tables = set(args.tables.split(","))
    quiet_logs()
    set_threads(args.threads)
    import torch
    from transformers import AutoTokenizer

    model_dir = resolve_bench_model(args.model)
    dtype = getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    token_lists = [tokenizer(s)["input_ids"] for s in SENTENCES[:args.prompts]]
    print(f"model {model_label(args.model, model_dir)}, {args.dtype}, {torch.get_num_threads()} threads\n")
    if "error" in tables:
        memory_and_error(model_dir, dtype, token_lists)
    if "matmul" in tables:
        from tests.support.vx_outputs import load_vx

        matmul_times(load_vx(model_dir, dtype), dtype, args.rounds)
    if "decode" in tables and args.e2e_rounds:
        decode(model_dir, args.dtype, args.e2e_rounds, args.decode_tokens)


if __name__ == "__main__":
    main()
