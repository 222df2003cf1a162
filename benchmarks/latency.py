"""Single-stream latency: time to first token on a long prompt and batch-1 decode speed, vx beside llama.cpp and
Hugging Face `generate` on the same model, in one run.

    python -m benchmarks.latency                            # vx's default model (its Q4_1 GGUF file), 3 rounds
    python -m benchmarks.latency --gguf path/to/model.gguf --rounds 5
    python -m benchmarks.latency --engines vx,llama.cpp --prompt-tokens 256 --decode-tokens 64

Engines (`--engines`, all by default):
- `vx`: `vx.LLM` (the engine in the process, as a script gets it) in its default dtype for the machine (`--dtype`
  to choose), a GGUF file's tensors kept quantized;
- `llama.cpp`: llama-cpp-python on the same GGUF file (skipped, with the reason, when it is not installed or the
  model is not a GGUF file);
- `hf`: Hugging Face `generate` on the same weights (transformers dequantizes a GGUF file itself), once per
  `--hf-dtypes` (float32, plus bfloat16 on CPUs that multiply it in hardware).

Each engine runs in a fresh child process per round, the engines interleaved round by round. A child loads the
model, warms up once on a prompt as long as the measured one, then measures
- TTFT: from the call to the first generated token of a prompt of exactly `--prompt-tokens` (512) token ids;
- decode: tokens/s of `--decode-tokens` (128) greedy tokens after a `--decode-prompt-tokens` (32) prompt, from the
  first generated token to the last (EOS ignored), so the prompt's prefill is not counted.
Every engine gets the same token ids in a round: random ids from the tokenizer's ordinary vocabulary, new in every
round and for every measurement, so vx's prefix cache and llama.cpp's prompt cache have nothing to reuse. The table
gives the median and the spread (min-max) over the rounds, and vx's ratio to each engine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections import Counter
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (MODEL_CHOICES, Table, engine_model_runner, interleaved_rounds, machine_description,
                               make_workload, median_spread, model_label, prompt_token_range, quiet_logs, ratio,
                               resolve_device, resolve_gguf_or_dir, rss_bytes, run_child, select_engines, set_threads)

ENGINES = ("vx", "llama.cpp", "hf")
WARMUP_TOKENS = 4

# A child's measurement of one request: seconds from the call to each generated token's arrival.
TokenClock = Callable[[list[int], int], list[float]]


# --------------------------------------------------------------------------------------------- the child
def measure_engine(timed: TokenClock, spec: dict[str, Any]) -> dict[str, Any]:
    """Warm up once, then time the first token of the long prompt and the decode after the short one."""
    wl = make_workload(3, (spec["prompt_tokens"],) * 2, (1, 1), tuple(spec["token_range"]), seed=spec["seed"])
    warm, long_prompt, other = wl.prompts
    timed(warm, WARMUP_TOKENS)
    ttft = timed(long_prompt, 1)[0]
    arrivals = timed(other[:spec["decode_prompt_tokens"]], spec["decode_tokens"] + 1)
    if len(arrivals) != spec["decode_tokens"] + 1:
        raise RuntimeError(f"asked for {spec['decode_tokens'] + 1} tokens, got {len(arrivals)}")
    return {"ttft_s": ttft, "decode_tok_s": spec["decode_tokens"] / (arrivals[-1] - arrivals[0])}


def engine_token_times(engine: Any, request_id: str, prompt: list[int], n: int) -> tuple[list[float], int]:
    """One greedy request of `n` tokens (EOS ignored) on an in-process `LLMEngine`, stepped here: the seconds from
    `add_request` to each token's arrival, and the prompt tokens its prefix cache served."""
    import vx

    params = vx.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, output_kind=vx.RequestOutputKind.DELTA)
    arrivals: list[float] = []
    cached = 0
    t0 = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter() - t0
            arrivals += [now] * len(out.outputs[0].token_ids)
            cached = max(cached, out.num_cached_tokens)
    return arrivals, cached


def run_vx(spec: dict[str, Any]) -> dict[str, Any]:
    """vx.LLM with the engine in this process; tokens timed as each engine step hands them out."""
    from vx.platform import prefer_openmp_wait_policy

    prefer_openmp_wait_policy()  # what a vx application's process gets: set before torch loads
    set_threads(spec["threads"])
    import vx

    base = rss_bytes()
    llm = vx.LLM(spec["model"], dtype=spec["dtype"], device=spec["device"])
    engine = llm.llm_engine
    # Its batch-1 decode graph compiles in the background while eager steps serve: measure the steady state.
    graphs = engine_model_runner(engine).decode_graphs
    if graphs is not None:
        graphs.wait()
    request_ids = itertools.count()
    cached = 0

    def timed(prompt: list[int], n: int) -> list[float]:
        nonlocal cached
        arrivals, served = engine_token_times(engine, str(next(request_ids)), prompt, n)
        cached = max(cached, served)
        return arrivals

    result = measure_engine(timed, spec)
    config = engine.config
    result.update(rss_bytes=rss_bytes() - base, dtype=config.model_config.dtype,
                  quantization=config.quant_config.method, cached_tokens=cached,
                  decode_compile_s=None if graphs is None else graphs.compile_seconds.get(1))
    llm.shutdown()
    return result


def run_llama_cpp(spec: dict[str, Any]) -> dict[str, Any]:
    """llama-cpp-python on the GGUF file; tokens timed as its `generate` yields them (greedy)."""
    from llama_cpp import Llama

    base = rss_bytes()
    n_ctx = spec["prompt_tokens"] + spec["decode_tokens"] + WARMUP_TOKENS + 16
    llm = Llama(model_path=spec["model"], n_ctx=n_ctx, n_threads=spec["threads"], n_threads_batch=spec["threads"],
                n_gpu_layers=-1 if spec["device"] == "cuda" else 0, verbose=False)

    def timed(prompt: list[int], n: int) -> list[float]:
        llm.reset()  # nothing of the previous prompt stays in the KV cache
        arrivals: list[float] = []
        t0 = time.perf_counter()
        # `generate` does not stop at EOS (create_completion does): it yields until we stop asking.
        for _ in llm.generate(prompt, temp=0.0, reset=True):
            arrivals.append(time.perf_counter() - t0)
            if len(arrivals) == n:
                break
        return arrivals

    result = measure_engine(timed, spec)
    result.update(rss_bytes=rss_bytes() - base)
    return result


def run_hf(spec: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face `generate`, greedy, EOS ignored; tokens timed by a streamer as generate hands them out."""
    set_threads(spec["threads"])
    import torch
    from transformers.generation.streamers import BaseStreamer

    from benchmarks.throughput import HFRunner

    quiet_logs()
    base = rss_bytes()
    device = spec["device"]
    model = HFRunner(spec["model_dir"], spec["dtype"], device).model

    class Clock(BaseStreamer):
        """Arrival time of every batch of tokens generate puts (the first put is the prompt)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: Any) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    def timed(prompt: list[int], n: int) -> list[float]:
        ids = torch.tensor([prompt], device=device)
        clock = Clock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, streamer=clock)
        return [t - t0 for t in clock.times[1:]]

    result = measure_engine(timed, spec)
    result.update(rss_bytes=rss_bytes() - base)
    return result


def _child(spec: dict[str, Any]) -> None:
    runner = {"vx": run_vx, "llama.cpp": run_llama_cpp}.get(spec["engine"], run_hf)
    print("RESULT " + json.dumps(runner(spec)), flush=True)


# -------------------------------------------------------------------------------------------- the parent
def gguf_weight_types(path: str) -> str:
    """The GGML types of a GGUF file's matrices by their share of its elements, e.g. 'Q4_1 79% + Q8_0 21%'
    (vx's header reader: it steps over the vocabulary that the gguf package's reader parses for seconds)."""
    from gguf import GGMLQuantizationType

    from vx.models.gguf.header import read_gguf_header

    elements: Counter[str] = Counter()
    for tensor in read_gguf_header(path).tensors:
        if len(tensor.dims) >= 2:  # norms and biases stay F32 in any file
            elements[GGMLQuantizationType(tensor.ggml_type).name] += math.prod(tensor.dims)
    total = sum(elements.values())
    return " + ".join(f"{name} {100 * n / total:.0f}%" for name, n in elements.most_common())


def _engines(ns: argparse.Namespace, gguf: str | None) -> tuple[list[str], list[str]]:
    """The engines to run (hf once per dtype, as hf-<dtype>) and the notes on those skipped."""
    from vx.platform import cpu_has_native_bf16

    names, skipped = select_engines(ns.engines, ENGINES, gguf)
    hf_dtypes = ns.hf_dtypes.split(",") if ns.hf_dtypes else \
        ["float32"] + (["bfloat16"] if cpu_has_native_bf16() else [])
    out = []
    for name in names:
        out += [f"hf-{d.strip()}" for d in hf_dtypes] if name == "hf" else [name]
    return out, skipped


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vx bench latency", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="a GGUF file (default: the default model's Q4_1 file)")
    ap.add_argument("--model", default="default",
                    help=f"instead of --gguf: one of {', '.join(MODEL_CHOICES)}, a .gguf file or a Hugging Face "
                         "model directory (llama.cpp runs only GGUF files)")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of every engine (default 3)")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="the TTFT prompt's length (default 512)")
    ap.add_argument("--decode-tokens", type=int, default=128, help="tokens timed after the first (default 128)")
    ap.add_argument("--decode-prompt-tokens", type=int, default=32, help="the decode run's prompt (default 32)")
    ap.add_argument("--dtype", default="auto", help="vx's dtype (default: auto, vx's choice for the machine)")
    ap.add_argument("--hf-dtypes", default=None,
                    help="comma-separated Hugging Face dtypes (default: float32, and bfloat16 where the CPU has "
                         "AMX or AVX512-BF16)")
    ap.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads of every engine (default: torch's default, the physical cores)")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (round r uses seed + r)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        _child(json.loads(ns.child))
        return
    if ns.rounds < 1 or ns.decode_tokens < 1 or not 1 <= ns.decode_prompt_tokens <= ns.prompt_tokens:
        ap.error("need rounds >= 1, decode tokens >= 1 and 1 <= decode prompt tokens <= prompt tokens")
    quiet_logs()
    gguf, model_dir = resolve_gguf_or_dir(ns.gguf or ns.model)
    engines, skipped = _engines(ns, gguf)
    for note in skipped:
        print(note, flush=True)
    if ns.threads is None:
        import torch

        ns.threads = torch.get_num_threads()
    device = resolve_device(ns.device)
    base_spec = dict(model_dir=model_dir, device=device, threads=ns.threads, prompt_tokens=ns.prompt_tokens,
                     decode_tokens=ns.decode_tokens, decode_prompt_tokens=ns.decode_prompt_tokens,
                     token_range=prompt_token_range(model_dir))

    def run_one(engine: str, r: int) -> dict | str:
        model = gguf if engine in ("vx", "llama.cpp") and gguf else model_dir
        dtype = engine.removeprefix("hf-") if engine.startswith("hf-") else ns.dtype
        spec = dict(base_spec, engine=engine, model=model, dtype=dtype, seed=ns.seed + r)
        return run_child("benchmarks.latency", ["--child", json.dumps(spec)], ns.threads)

    results, failures = interleaved_rounds(engines, ns.rounds, run_one)

    weights = f"{gguf_weight_types(gguf)} GGUF" if gguf else "checkpoint"
    label = os.path.basename(gguf) if gguf else model_label(ns.model, model_dir)
    table = Table(f"Single-stream latency: {label}, {device}, {ns.threads} threads",
                  ["engine", "dtype / weights", f"TTFT {ns.prompt_tokens} ms", "decode tok/s", "RSS added MiB",
                   "vx TTFT vs it", "vx decode vs it"])
    vx_runs = results.get("vx") or []
    vx_ttft = statistics.median(r["ttft_s"] for r in vx_runs) if vx_runs else float("nan")
    vx_decode = statistics.median(r["decode_tok_s"] for r in vx_runs) if vx_runs else float("nan")
    for engine in engines:
        runs = results[engine]
        if not runs:
            table.add(engine, failures.get(engine, "no result"))
            continue
        if engine == "vx":
            quant = runs[0]["quantization"]
            what = f"{runs[0]['dtype']} / {weights + ' kept quantized' if gguf else quant or 'float weights'}"
        elif engine == "llama.cpp":
            what = weights
        else:
            what = engine.removeprefix("hf-") + (" / dequantized" if gguf else "")
        ttft, ttft_spread = median_spread([r["ttft_s"] for r in runs], 1000.0)
        decode, decode_spread = median_spread([r["decode_tok_s"] for r in runs])
        rss, _ = median_spread([r["rss_bytes"] for r in runs], 1 / 2**20)
        table.add(engine, what, f"{ttft:,.0f} ({ttft_spread})", f"{decode:.1f} ({decode_spread})", f"{rss:.0f}",
                  ratio(ttft / 1000.0, vx_ttft), ratio(vx_decode, decode))
    table.notes.append(f"Medians of {ns.rounds} interleaved rounds (spread min-max), each engine in a fresh process. "
                       f"Machine: {machine_description()}; threads: {ns.threads} for every engine.")
    table.notes.append(f"TTFT: a {ns.prompt_tokens}-token prompt to its first token. Decode: {ns.decode_tokens} "
                       f"greedy tokens after the first, on a {ns.decode_prompt_tokens}-token prompt, EOS ignored. "
                       "Ratios above 1: vx is faster (their TTFT / vx's; vx's tokens/s / theirs).")
    table.notes.append("RSS added: the process's resident memory after the runs, above the same process once it had "
                       "imported the engine's libraries (torch and vx; torch and transformers; llama_cpp).")
    compile_s = [r["decode_compile_s"] for r in vx_runs if r.get("decode_compile_s") is not None]
    if compile_s:
        table.notes.append(f"vx decodes through its compiled batch-1 graph: compiled in the background at start-up "
                           f"(eager steps serve meanwhile) in {median_spread(compile_s)[0]:.1f} s (median), before "
                           "anything was timed.")
    if any(r.get("cached_tokens") for r in vx_runs):
        table.notes.append("WARNING: vx's prefix cache served part of a measured prompt.")
    table.notes += skipped
    for engine, why in failures.items():
        table.notes.append(f"{engine}: {why}")
    table.print()


if __name__ == "__main__":
    main()
