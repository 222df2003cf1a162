"""Roofline: what this machine can do at the model's shapes, and how close vx's decode gets to it.

    python -m benchmarks.roofline                                  # default model, fp32 + bf16, batch 1..256
    python -m benchmarks.roofline --model qwen2.5-0.5b-random --dtypes float32 --batches 1,16,64
    python -m benchmarks.roofline --vx-tokens-per-s 850 --vx-batch 32  # judge a number measured elsewhere

Measures `F.linear` time for each per-layer GEMM of the model (qkv, o, gate_up, down) and the lm_head, at
token batches 1..256 and in each dtype, and a large tensor copy. From those:

- peak GFLOP/s: the best GEMM rate measured at the model's shapes;
- peak GB/s: the better of the copy rate (read + write) and the weight-streaming rate of batch-1 GEMMs
  (each GEMM is timed over one distinct weight per layer, as in a real step, so weights come from memory);
- decode-step lower bound at batch B: max(FLOPs / peak GFLOP/s, bytes / peak GB/s), with the FLOPs of
  every linear layer and of attention over `--context-len` tokens, and the bytes of every weight (read
  once per step) plus the KV cache of B sequences of `--context-len` tokens.

Then vx decodes B short requests (`--vx-batch`, unless `--no-vx`) and the report gives vx's tokens/s as a
fraction of that bound. `roofline_tokens_per_s(model_dir, batch, dtype)` gives the bound to other scripts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (Table, add_model_args, measure, model_label, parse_int_list, quiet_logs,
                               resolve_bench_model, resolve_device, set_threads, torch_dtype)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Gemm:
    """One linear layer of a decoder step: y[B, out] = x[B, in] @ W[out, in]^T, `per_step` times a step."""

    name: str
    in_features: int
    out_features: int
    per_step: int


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama/Qwen-style decoder that decide its cost per step."""

    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, cfg: Any) -> "ModelShape":
        heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(int(cfg.hidden_size), int(cfg.intermediate_size), int(cfg.num_hidden_layers), heads,
                   int(getattr(cfg, "num_key_value_heads", None) or heads), int(head_dim), int(cfg.vocab_size))

    @classmethod
    def from_model_dir(cls, model_dir: str) -> "ModelShape":
        from transformers import AutoConfig

        return cls.from_config(AutoConfig.from_pretrained(model_dir))

    def gemms(self) -> list[Gemm]:
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        L = self.num_layers
        return [Gemm("qkv", self.hidden, q + 2 * kv, L), Gemm("o", q, self.hidden, L),
                Gemm("gate_up", self.hidden, 2 * self.intermediate, L),
                Gemm("down", self.intermediate, self.hidden, L), Gemm("lm_head", self.hidden, self.vocab, 1)]

    @property
    def linear_params(self) -> int:
        """Weights every decode step reads (embedding rows and norms are negligible and left out)."""
        return sum(g.in_features * g.out_features * g.per_step for g in self.gemms())

    def step_flops(self, batch: int, context_len: int = 0) -> float:
        """FLOPs of one step over `batch` tokens, each attending to `context_len` cached tokens."""
        attn = 4 * self.num_heads * self.head_dim * context_len * self.num_layers  # QK^T and PV
        return float(batch) * (2 * self.linear_params + attn)

    def step_bytes(self, batch: int, dtype_bytes: int, context_len: int = 0) -> float:
        """Bytes one decode step must read at least: every weight once, and each sequence's KV cache."""
        kv = batch * context_len * 2 * self.num_layers * self.num_kv_heads * self.head_dim
        return float(self.linear_params + kv) * dtype_bytes


@dataclass
class GemmTiming:
    """The best time of one `F.linear` at one shape."""

    gemm: Gemm
    batch: int
    dtype: str
    seconds: float

    @property
    def gflops(self) -> float:
        return 2.0 * self.batch * self.gemm.in_features * self.gemm.out_features / self.seconds / 1e9

    @property
    def gbps(self) -> float:
        g, b = self.gemm, DTYPE_BYTES[self.dtype]
        moved = (g.in_features * g.out_features + self.batch * (g.in_features + g.out_features)) * b
        return moved / self.seconds / 1e9


@dataclass
class Limits:
    """What the machine reached in one dtype: peak GEMM rate and memory bandwidth."""

    dtype: str
    peak_gflops: float
    copy_gbps: float
    gemv_gbps: float

    @property
    def peak_gbps(self) -> float:
        return max(self.copy_gbps, self.gemv_gbps)


def _sync(device: str) -> Any:
    import torch

    return torch.cuda.synchronize if device == "cuda" else None


def time_gemm(gemm: Gemm, batches: list[int], dtype: str, device: str, min_time: float) -> list[GemmTiming]:
    """Best-of-N time of `F.linear` at the GEMM's shape for each token batch size.

    Like a decoder step, each timed round runs the GEMM once on each of `per_step` distinct weight
    matrices (one per layer), so that the weights stream from memory instead of sitting in a cache; the
    time of one GEMM is the round's time / `per_step`.
    """
    import torch
    import torch.nn.functional as F

    td = torch_dtype(dtype)
    weights = [torch.randn(gemm.out_features, gemm.in_features, dtype=td, device=device).mul_(0.02)
               for _ in range(gemm.per_step)]
    out = []
    with torch.inference_mode():
        for b in batches:
            x = torch.randn(b, gemm.in_features, dtype=td, device=device)

            def round_() -> None:
                for w in weights:
                    F.linear(x, w)

            times = measure(round_, min_time=min_time, min_reps=2, sync=_sync(device))
            out.append(GemmTiming(gemm, b, dtype, min(times) / gemm.per_step))
    return out


def copy_bandwidth(dtype: str, device: str, min_time: float, nbytes: int = 256 * 2**20) -> float:
    """GB/s of a large `copy_` (bytes read + bytes written)."""
    import torch

    n = nbytes // DTYPE_BYTES[dtype]
    src = torch.ones(n, dtype=torch_dtype(dtype), device=device)
    dst = torch.empty_like(src)
    times = measure(lambda: dst.copy_(src), min_time=min_time, min_reps=3, sync=_sync(device))
    return 2 * n * DTYPE_BYTES[dtype] / min(times) / 1e9


def measure_shapes(shape: ModelShape, dtype: str, device: str, batches: list[int],
                   min_time: float) -> tuple[list[GemmTiming], Limits]:
    """Time every GEMM of `shape` at every batch size (batch 1 always included) and derive the limits."""
    batches = sorted(set(batches) | {1})
    timings = [t for g in shape.gemms() for t in time_gemm(g, batches, dtype, device, min_time)]
    peak = max(t.gflops for t in timings)
    gemv = max(t.gbps for t in timings if t.batch == 1)
    return timings, Limits(dtype, peak, copy_bandwidth(dtype, device, min_time), gemv)


def step_lower_bound(shape: ModelShape, batch: int, limits: Limits, context_len: int = 0) -> tuple[float, float]:
    """(compute-bound seconds, memory-bound seconds) of one decode step of `batch` sequences."""
    t_compute = shape.step_flops(batch, context_len) / (limits.peak_gflops * 1e9)
    t_memory = shape.step_bytes(batch, DTYPE_BYTES[limits.dtype], context_len) / (limits.peak_gbps * 1e9)
    return t_compute, t_memory


_LIMITS_CACHE: dict[tuple, Limits] = {}


def roofline_tokens_per_s(model_dir: str, batch: int, dtype: str, device: str = "cpu", context_len: int = 0,
                          min_time: float = 0.1) -> float:
    """Upper bound on decode tokens/s of `batch` sequences of the model in `model_dir` on this machine.

    Measures (once per process and model/dtype/device) the model's GEMMs at batch 1 and at
    max(batch, 256) to find the peak GFLOP/s and GB/s, then returns batch / max(compute, memory) time.
    """
    shape = ModelShape.from_model_dir(model_dir)
    key = (shape, dtype, device, max(batch, 256))
    if key not in _LIMITS_CACHE:
        _LIMITS_CACHE[key] = measure_shapes(shape, dtype, device, [max(batch, 256)], min_time)[1]
    return batch / max(step_lower_bound(shape, batch, _LIMITS_CACHE[key], context_len))


def measure_vx_decode(model_dir: str, batch: int, dtype: str, device: str, prompt_len: int,
                      output_len: int, seed: int = 0) -> float:
    """vx's generated tokens/s for `batch` requests of `prompt_len` random tokens and `output_len` new ones
    each, all admitted at once (prefill is short, so this is mostly decode at batch `batch`)."""
    import vx
    from benchmarks.common import make_workload, prompt_token_range

    wl = make_workload(batch, (prompt_len, prompt_len), (output_len, output_len), prompt_token_range(model_dir),
                       seed)
    llm = vx.LLM(model_dir, dtype=dtype, device=device, max_num_seqs=max(batch, 1),
                 max_num_batched_tokens=max(512, batch * prompt_len),
                 max_model_len=prompt_len + output_len + 16)
    try:
        params = vx.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        llm.generate(wl.prompts[:2], vx.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(wl.prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
    finally:
        llm.shutdown()
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def _gemm_table(shape: ModelShape, timings: list[GemmTiming], dtype: str) -> Table:
    names = [g.name for g in shape.gemms()]
    table = Table(f"F.linear GFLOP/s at the model's shapes ({dtype})",
                  ["batch"] + names + ["all GEMMs ms/step", "weights GB/s"])
    for b in sorted({t.batch for t in timings}):
        row = {t.gemm.name: t for t in timings if t.batch == b}
        step = sum(row[n].seconds * row[n].gemm.per_step for n in names)
        wbytes = shape.linear_params * DTYPE_BYTES[dtype]
        table.add(b, *[row[n].gflops for n in names], step * 1e3, wbytes / step / 1e9)
    shapes = ", ".join(f"{g.name} {g.in_features}x{g.out_features} (x{g.per_step})" for g in shape.gemms())
    table.notes.append(f"shapes (in x out, per step): {shapes}")
    return table


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vx bench roofline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes to measure")
    ap.add_argument("--batches", type=parse_int_list, default=[1, 2, 4, 8, 16, 32, 64, 128, 256],
                    help="token batch sizes (default 1,2,4,...,256)")
    ap.add_argument("--min-time", type=float, default=0.1, help="seconds of repetitions per measurement")
    ap.add_argument("--context-len", type=int, default=256,
                    help="cached tokens each sequence attends to in the decode bound (default 256)")
    ap.add_argument("--vx-batch", type=int, default=32, help="requests vx decodes at once (default 32)")
    ap.add_argument("--vx-tokens-per-s", type=float, help="judge this vx rate instead of measuring one")
    ap.add_argument("--vx-dtype", default=None, help="dtype of the vx run (default: the first of --dtypes)")
    ap.add_argument("--vx-prompt-len", type=int, default=16)
    ap.add_argument("--vx-output-len", type=int, default=64)
    ap.add_argument("--no-vx", action="store_true", help="only measure the machine")
    args = ap.parse_args(argv)
    quiet_logs()
    set_threads(args.threads)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPE_BYTES:
            ap.error(f"unknown dtype {d!r}; choose from {', '.join(DTYPE_BYTES)}")
    device = resolve_device(args.device)
    model_dir = resolve_bench_model(args.model)
    shape = ModelShape.from_model_dir(model_dir)
    label = model_label(args.model, model_dir)
    import torch

    print(f"roofline: {label} ({shape.linear_params / 1e6:.1f}M linear weights, {shape.num_layers} layers), "
          f"{device}, torch threads {torch.get_num_threads()}\n", flush=True)

    limits: dict[str, Limits] = {}
    gemm_step: dict[tuple[str, int], float] = {}  # (dtype, batch) -> seconds of all GEMMs of a step
    for d in dtypes:
        timings, limits[d] = measure_shapes(shape, d, device, args.batches, args.min_time)
        for t in timings:
            gemm_step[(d, t.batch)] = gemm_step.get((d, t.batch), 0.0) + t.seconds * t.gemm.per_step
        _gemm_table(shape, timings, d).print()

    lim_table = Table("Machine limits measured at these shapes", ["dtype", "peak GFLOP/s", "copy GB/s",
                                                                  "GEMV GB/s", "ridge FLOP/byte"])
    for d, lim in limits.items():
        lim_table.add(d, lim.peak_gflops, lim.copy_gbps, lim.gemv_gbps, lim.peak_gflops / lim.peak_gbps)
    lim_table.print()

    bound = Table(f"Decode-step lower bound (context {args.context_len} tokens per sequence)",
                  ["batch"] + [f"{d} {c}" for d in dtypes for c in ("compute ms", "memory ms", "max tok/s")])
    for b in sorted(set(args.batches)):
        cells: list[Any] = [b]
        for d in dtypes:
            tc, tm = step_lower_bound(shape, b, limits[d], args.context_len)
            cells += [tc * 1e3, tm * 1e3, b / max(tc, tm)]
        bound.add(*cells)
    bound.print()

    if args.no_vx and args.vx_tokens_per_s is None:
        return
    vx_dtype = args.vx_dtype or dtypes[0]
    if vx_dtype not in limits:
        limits[vx_dtype] = measure_shapes(shape, vx_dtype, device, [1, max(args.vx_batch, 256)], args.min_time)[1]
    if args.vx_tokens_per_s is not None:
        vx_tps, context, source = args.vx_tokens_per_s, args.context_len, "given"
    else:
        vx_tps = measure_vx_decode(model_dir, args.vx_batch, vx_dtype, device, args.vx_prompt_len,
                                   args.vx_output_len, args.seed)
        context, source = args.vx_prompt_len + args.vx_output_len // 2, "measured"
    limit = args.vx_batch / max(step_lower_bound(shape, args.vx_batch, limits[vx_dtype], context))
    if (vx_dtype, args.vx_batch) not in gemm_step:
        gemm_step[(vx_dtype, args.vx_batch)] = sum(
            t.seconds * t.gemm.per_step for g in shape.gemms()
            for t in time_gemm(g, [args.vx_batch], vx_dtype, device, args.min_time))
    gemm_tps = args.vx_batch / gemm_step[(vx_dtype, args.vx_batch)]
    t = Table("vx against the roofline", ["", "batch", "dtype", "tokens/s", "fraction of roofline"])
    t.add(f"vx ({source})", args.vx_batch, vx_dtype, vx_tps, f"{100 * vx_tps / limit:.1f}%")
    t.add("torch F.linear alone at the model's shapes", args.vx_batch, vx_dtype, gemm_tps,
          f"{100 * gemm_tps / limit:.1f}%")
    t.add("roofline", args.vx_batch, vx_dtype, limit, "100%")
    t.notes.append(f"vx reaches {100 * vx_tps / gemm_tps:.1f}% of the speed of its GEMMs alone (measured "
                   "F.linear time of one step's linear layers, no attention or other work)")
    if source == "measured":
        t.notes.append(f"vx run: {args.vx_batch} requests x ({args.vx_prompt_len} prompt + {args.vx_output_len} "
                       f"generated) tokens, prefill included; bound at mean context {context}.")
    t.print()


if __name__ == "__main__":
    main()
