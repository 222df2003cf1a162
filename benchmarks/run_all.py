"""Run the whole benchmark suite in sequence and print one markdown report (optionally also to a file).

    python -m benchmarks.run_all                      # quick sizes: minutes on a laptop CPU
    python -m benchmarks.run_all --full --out bench.md  # the issue's sizes (long on a CPU)
    python -m benchmarks.run_all --only throughput,engine_overhead --model tiny

Each benchmark runs in this process through its `main(argv)`; one that fails is reported and the others
still run (the exit status is then 1). `--model` replaces the model of every model-running benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import sys
import time
import traceback
from typing import TextIO

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import get_main
from benchmarks.common import Table

# (benchmark, arguments) in run order; the model-running ones take --model.
QUICK: list[tuple[str, list[str]]] = [
    ("engine_overhead", ["--steps", "32"]),
    ("roofline", ["--batches", "1,8,64", "--min-time", "0.05", "--vx-batch", "8", "--vx-output-len", "16"]),
    ("throughput", ["--num-requests", "16", "--max-prompt-len", "128", "--max-output-len", "32",
                    "--hf-batch-sizes", "8,16", "--hf-probe-tokens", "8"]),
    ("decode_step", ["--batch", "16", "--context", "128", "--steps", "4"]),
    ("quant_matmul", ["--shapes", "qkv,down,lm_head", "--batches", "1,8", "--rounds", "3"]),
    ("prefix_caching", ["--num-requests", "4", "--prefix-len", "128", "--suffix-len", "8", "--output-len", "4"]),
    ("streaming", ["--num-requests", "8", "--rate", "0.5", "--output-len", "16"]),
    ("async_overhead", ["--num-requests", "8", "--sequential", "2", "--output-len", "16"]),
    ("startup", ["--runs", "1"]),
    ("latency", ["--rounds", "1", "--prompt-tokens", "128", "--decode-tokens", "16"]),
    ("batch_throughput", ["--num-requests", "8", "--new-tokens", "16", "--rounds", "1", "--hf-batch-sizes", "4,8",
                          "--hf-probe-tokens", "4"]),
    ("vs_llama_cpp", ["--shapes", "default", "--rounds", "1", "--decode-tokens", "16", "--prefill-tokens", "128",
                      "--concurrent", "8", "--concurrent-tokens", "16"]),
]
FULL: list[tuple[str, list[str]]] = [
    ("engine_overhead", ["--steps", "64"]),
    ("roofline", []),
    ("throughput", []),
    ("throughput", ["--model", "qwen2.5-0.5b-random"]),
    ("decode_step", []),
    ("quant_matmul", []),
    ("decode_step", ["--backends", "auto", "--kv-cache-dtypes", "auto,fp8_e4m3,int8", "--batch", "32",
                     "--context", "1000", "--repeats", "5"]),
    ("prefix_caching", ["--full"]),
    ("streaming", ["--num-requests", "64", "--rate", "1"]),
    ("async_overhead", []),
    ("startup", ["--runs", "3"]),
    ("latency", []),
    ("batch_throughput", []),
    ("hf_quantization", []),
    ("parallel", []),
    ("vs_llama_cpp", []),
]
MODEL_FREE = {"engine_overhead", "quant_matmul", "vs_llama_cpp"}  # vs_llama_cpp runs its own shapes


class _Tee(io.TextIOBase):
    """Writes to several text streams at once (the terminal and the report buffer)."""

    def __init__(self, *streams: TextIO) -> None:
        self.streams = streams

    def write(self, s: str) -> int:
        for st in self.streams:
            st.write(s)
        return len(s)

    def flush(self) -> None:
        for st in self.streams:
            st.flush()


def plan(full: bool, only: list[str] | None, model: str | None,
         extra_model_args: list[str]) -> list[tuple[str, list[str]]]:
    """The (benchmark, argv) list to run."""
    steps = FULL if full else QUICK
    out = []
    for name, argv in steps:
        if only and name not in only:
            continue
        argv = list(argv)
        if name not in MODEL_FREE:
            if model and "--model" in argv:
                argv[argv.index("--model") + 1] = model
            elif model:
                argv += ["--model", model]
            argv += extra_model_args
        if (name, argv) not in out:  # a --model override can make two entries the same
            out.append((name, argv))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vx bench run_all", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="the issue's sizes instead of quick ones")
    ap.add_argument("--out", help="also write the report to this file")
    ap.add_argument("--only", help="comma-separated benchmark names to run")
    ap.add_argument("--model", help="model for every model-running benchmark (default: each one's default)")
    ap.add_argument("--dtype", default=None, help="dtype for every model-running benchmark")
    ap.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    extra: list[str] = []
    for flag, value in (("--dtype", args.dtype), ("--device", args.device), ("--threads", args.threads)):
        if value is not None:
            extra += [flag, str(value)]
    steps = plan(args.full, only, args.model, extra)
    if not steps:
        ap.error("nothing to run")

    buf = io.StringIO()
    tee = _Tee(sys.stdout, buf)
    import torch

    header = (f"# vx benchmarks ({'full' if args.full else 'quick'} sizes)\n\n"
              f"{time.strftime('%Y-%m-%d %H:%M:%S')}; {platform.platform()}; python {platform.python_version()}; "
              f"torch {torch.__version__}; {os.cpu_count()} CPUs; CUDA {'yes' if torch.cuda.is_available() else 'no'}; "
              f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
    print(header, file=tee, flush=True)
    summary = Table("Summary", ["benchmark", "arguments", "seconds", "status"])
    failed = False
    for name, bargv in steps:
        print(f"## {name}\n\n`vx bench {name} {' '.join(bargv)}`\n", file=tee, flush=True)
        t0 = time.perf_counter()
        status = "ok"
        with contextlib.redirect_stdout(tee):
            try:
                get_main(name)(bargv)
            except (Exception, SystemExit) as e:  # noqa: BLE001 - one failure must not stop the suite
                if isinstance(e, SystemExit) and not e.code:
                    pass
                else:
                    failed = True
                    status = f"FAILED: {type(e).__name__}: {e}"
                    print(f"```\n{traceback.format_exc()}```\n")
        summary.add(name, " ".join(bargv) or "(defaults)", time.perf_counter() - t0, status)
    print(summary.render(), file=tee, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(buf.getvalue())
        print(f"report written to {args.out}")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
