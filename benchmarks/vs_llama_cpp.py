"""vx beside llama.cpp and Hugging Face transformers at the sizes people run: per model shape, on one GGUF file, batch-1
decode, a 512-token prefill, 32 concurrent requests and memory, as medians and ratios from one run.

    python -m benchmarks.vs_llama_cpp                                   # shapes default, 1.7b and 8b; 3 rounds
    python -m benchmarks.vs_llama_cpp --shapes default,1.7b --rounds 3
    python -m benchmarks.vs_llama_cpp --shapes 8b --rounds 1 --llama-cpp-bin ~/llama.cpp/build/bin

Shapes: `default` is vx's default model's own file (SmolLM2-135M-Instruct, Q4_1); `1.7b` and `8b` are random-weight
Q4_K_M files in the shapes of SmolLM2-1.7B and Llama-3-8B (`benchmarks.gguf_shapes`: the 8b with the default
tokenizer's 49152-token vocabulary), written once into the bench cache; `tiny` is a 2-layer one for tests. Every
engine runs the same file on the same threads (`--threads`, 2):

- vx through `AsyncLLM` (its engine in a process of its own, streaming: how applications meet vx) and through
  `vx.LLM` (its engine stepped in this process): one engine of each per shape, reused by every round, with vx's
  defaults but `max_model_len` (`--context`, 4096) and a KV cache of `num_kv_blocks` blocks that hold that context or
  the concurrent requests. Their decode graphs compile before timing: the run waits for each engine to settle (no
  compile child, no CPU used for 2 s; `benchmarks.startup`) and says so;
- llama.cpp's own programs (`benchmarks.llama_cpp_programs`): `llama-bench -p 512 -n 64 -r 1` (a prefill and a decode
  from an empty context, each after a warm-up run) and `llama-server -np 32` (started each round, warmed up, sent all
  requests at once on /completion with `ignore_eos`); "not built" where the programs are missing;
- Hugging Face `generate` on the file dequantized by transformers (kept as a bfloat16 copy where the CPU multiplies
  bf16, else float32, in the bench cache), in a fresh process per round (`benchmarks.latency`'s child); skipped,
  saying why, where it would not fit in the memory available.

Measures, in rounds where the engines take turns, each round with new random prompts (nothing for a prefix cache):
- batch-1 decode, tok/s: `--decode-tokens` (64) greedy tokens after the first, EOS ignored, from the first token's
  arrival to the last's after a 32-token prompt (llama-bench: tg64, 64 steps from an empty context);
- prefill: ms from the call to the first token of a `--prefill-tokens` (512) prompt (llama-bench: pp512);
- concurrent, tok/s: `--concurrent` (32) requests of 32-token prompts and `--concurrent-tokens` (128) new tokens each,
  all sent at once: requests x new tokens / seconds to the last answer (prefill included);
- memory (MiB): vx's engine process (RSS) after warming up on one 32-token and one 512-token prompt, beside
  `llama-server -c 4096 -np 1` after the same two; both again after the concurrent runs; and the floor beside them:
  the file's tensor bytes plus a `--context`-token KV cache in each engine's KV dtype;
- weights a decode step reads: vx's (its layers' and LM head's weights as it holds them and the norms; not the
  embedding table, of which a step reads one row) against the file's (the same tensors as stored), and the machine's
  read bandwidth (a `torch.sum` over `--bandwidth-gib` GiB on the threads, best of 5): the fraction of it an engine's
  batch-1 decode reaches is weight bytes x tokens/s / bandwidth.

Cells: the median over the rounds and the spread ((max - min) / median). Ratios compare vx's AsyncLLM with each:
speeds as vx / it (above 1: vx faster), prefill as its time / vx's, memory as vx / it (below 1: vx smaller).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import llama_cpp_programs as llama
from benchmarks.common import (Table, engine_model_runner, machine_description, make_workload, measure, quiet_logs,
                               ratio, run_child, set_threads)
from benchmarks.gguf_memory import bare_torch_rss

MIB = 2**20
PROMPT_TOKENS = 32  # of the decode and concurrent requests
WARMUP_TOKENS = 4
ENGINES = ("vx AsyncLLM", "vx.LLM", "llama.cpp", "HF")


@dataclass
class ShapeRun:
    """One shape's file, its settings and what was measured: samples[(measure, engine)] per round, or why not."""

    name: str
    gguf: str
    model_dir: str
    token_range: tuple[int, int]
    samples: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)  # engine -> why it has no figures
    failures: dict[str, str] = field(default_factory=dict)  # engine -> its last failure
    facts: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, what: str, engine: str, value: float) -> None:
        self.samples.setdefault((what, engine), []).append(value)

    def prompts(self, count: int, length: int, seed: int) -> list[list[int]]:
        return make_workload(count, (length, length), (1, 1), self.token_range, seed=seed).prompts


# ------------------------------------------------------------------------------------------------ the file
def shape_file(name: str, seed: int) -> tuple[str, str]:
    """(the GGUF file, a short label) of shape `name`."""
    from benchmarks.gguf_shapes import SHAPES, random_gguf
    from vx.config.model_source import default_model_file

    if name == "default":
        return default_model_file(), "default model (SmolLM2-135M-Instruct, Q4_1 file)"
    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; choose from default, {', '.join(SHAPES)}")
    return random_gguf(name, seed), f"{SHAPES[name].label}, random Q4_K_M weights"


def token_range(gguf: str) -> tuple[int, int]:
    """[lo, hi) of token ids for random prompts: the file's vocabulary above the low ids of special tokens (as
    `benchmarks.common.prompt_token_range`, read from the GGUF header in milliseconds)."""
    from vx.models.gguf.header import read_gguf_header

    hi = read_gguf_header(gguf).array_lengths["tokenizer.ggml.tokens"]
    return min(100, hi // 4), hi


def file_weight_bytes(gguf: str) -> tuple[int, int, int]:
    """(bytes of all the file's tensors, of those a decode step reads, weights in all): a step reads every tensor
    but the token embedding, unless the LM head is that embedding (tied)."""
    from vx.models.gguf.header import read_gguf_header

    tensors = read_gguf_header(gguf).tensors
    total = sum(t.nbytes for t in tensors)
    tied = not any(t.name == "output.weight" for t in tensors)
    step = total - (0 if tied else sum(t.nbytes for t in tensors if t.name == "token_embd.weight"))
    return total, step, sum(math.prod(t.dims) for t in tensors)


def decode_weight_bytes(model: Any) -> int:
    """Bytes of the weights one vx decode step reads, as the model holds them: every module's parameters (the
    norms) and its GGUF layers' kernels and LM head; not the embedding rows (a step reads one row) nor buffers."""
    total = 0
    for module in model.modules():
        total += sum(p.nbytes for p in module.parameters(recurse=False))
        total += sum(k.nbytes for k in module.__dict__.get("gguf_kernels", ()))
        head = module.__dict__.get("gguf_head")
        total += head.nbytes if head is not None else 0
    return total


def read_bandwidth(gib: float, reps: int = 5) -> float:
    """GB/s of a `torch.sum` over a float32 tensor of `gib` GiB (best of `reps`, on torch's threads)."""
    import torch

    x = torch.ones(int(gib * 2**30) // 4)
    times = measure(lambda: x.sum(), min_time=0.0, min_reps=reps, max_reps=reps)
    return x.nbytes / min(times) / 1e9


# ------------------------------------------------------------------------------------------------------- vx
async def stream_times(llm: Any, prompt: list[int], n: int) -> list[float]:
    """Seconds from the call to each of `n` greedy tokens (EOS ignored) streamed by an AsyncLLM."""
    import vx

    params = vx.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, output_kind=vx.RequestOutputKind.DELTA)
    arrivals: list[float] = []
    t0 = time.perf_counter()
    async for out in llm.generate(prompt, params):
        arrivals += [time.perf_counter() - t0] * len(out.outputs[0].token_ids)
    if len(arrivals) != n:
        raise RuntimeError(f"asked vx for {n} tokens, got {len(arrivals)}")
    return arrivals


async def stream_all(llm: Any, prompts: list[list[int]], n: int) -> float:
    """Seconds for an AsyncLLM to stream `n` tokens to each of `prompts`, all sent at once."""
    import anyio

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for p in prompts:
            tg.start_soon(stream_times, llm, p, n)
    return time.perf_counter() - t0


def settle(llm: Any, what: str) -> None:
    """Wait until the AsyncLLM's engine has settled (its decode graph compiled and loaded), saying so; at once where
    it compiles none (VX_DECODE_COMPILE=off)."""
    import psutil

    from benchmarks.startup import wait_until_settled
    from vx import envs

    if envs.VX_DECODE_COMPILE.get() == "off":
        return

    print(f"vx: waiting for the engine to settle ({what})...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    wait_until_settled(psutil.Process(llm._client.engine.proc.pid), quiet_s=2.0)
    print(f"vx: settled after {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)


def engine_rss(llm: Any) -> int:
    import psutil

    return psutil.Process(llm._client.engine.proc.pid).memory_info().rss


def engine_args(ns: argparse.Namespace) -> dict[str, Any]:
    """vx's engine settings beside its defaults: the context, and KV blocks that hold it or the concurrent requests."""
    block = 16  # vx's default block size
    per_request = -(-(PROMPT_TOKENS + ns.concurrent_tokens + 1) // block)
    blocks = max(-(-ns.context // block) + 1, ns.concurrent * per_request, -(-ns.prefill_tokens // block) + 2)
    return dict(max_model_len=ns.context, num_kv_blocks=blocks, block_size=block)


# ----------------------------------------------------------------------------------------------- one shape
async def run_shape(run: ShapeRun, ns: argparse.Namespace, llama_dir: str | None, hf: dict[str, str]) -> None:
    """Every measure of one shape, rounds interleaved; results into `run`."""
    import vx
    from benchmarks.latency import engine_token_times

    args = engine_args(ns)
    run.facts["engine_args"] = args
    async with vx.AsyncLLM(run.gguf, **args) as allm:
        run.facts["vx_dtype"] = allm.config.model_config.dtype
        await stream_times(allm, run.prompts(1, PROMPT_TOKENS, -1)[0], WARMUP_TOKENS)
        await stream_times(allm, run.prompts(1, ns.prefill_tokens, -2)[0], 1)
        settle(allm, "batch-1 decode graph")
        run.add("rss_context", "vx AsyncLLM", engine_rss(allm))
        if llama_dir:
            await _attempt_async(run, "llama.cpp", "llama-server", _llama_memory(run, ns, llama_dir))
        llm = vx.LLM(run.gguf, **args)
        try:
            graphs = engine_model_runner(llm.llm_engine).decode_graphs
            if graphs is not None:
                print("vx.LLM: waiting for its batch-1 decode graph...", file=sys.stderr, flush=True)
                graphs.wait()
            run.facts["vx_step_bytes"] = decode_weight_bytes(engine_model_runner(llm.llm_engine).model)
            engine_token_times(llm.llm_engine, "warm", run.prompts(1, PROMPT_TOKENS, -3)[0], WARMUP_TOKENS)
            await stream_all(allm, run.prompts(ns.concurrent, PROMPT_TOKENS, -4), WARMUP_TOKENS)
            settle(allm, f"decode graphs for {ns.concurrent} requests")
            await _rounds(run, ns, llama_dir, hf, allm, llm)
        finally:
            llm.shutdown()
        run.add("rss_concurrent", "vx AsyncLLM", engine_rss(allm))


async def _rounds(run: ShapeRun, ns: argparse.Namespace, llama_dir: str | None, hf: dict[str, str], allm: Any,
                  llm: Any) -> None:
    """The measured rounds: the engines take turns, each round with new prompts."""
    from benchmarks.latency import engine_token_times

    for r in range(ns.rounds):
        seed = 1000 * (r + 1)

        def step(what: str, engine: str) -> None:
            print(f"{run.name}, round {r + 1}/{ns.rounds}: {engine} {what} ...", file=sys.stderr, flush=True)

        step("decode", "vx AsyncLLM")
        t = await stream_times(allm, run.prompts(1, PROMPT_TOKENS, seed)[0], ns.decode_tokens + 1)
        run.add("decode", "vx AsyncLLM", ns.decode_tokens / (t[-1] - t[0]))
        step("decode", "vx.LLM")
        t, _ = engine_token_times(llm.llm_engine, f"r{r}", run.prompts(1, PROMPT_TOKENS, seed + 1)[0],
                                  ns.decode_tokens + 1)
        run.add("decode", "vx.LLM", ns.decode_tokens / (t[-1] - t[0]))
        if llama_dir:
            step("decode and prefill", "llama-bench")
            _attempt(run, "llama.cpp", "llama-bench", lambda: _llama_bench(run, ns, llama_dir))
        step("prefill", "vx AsyncLLM")
        t = await stream_times(allm, run.prompts(1, ns.prefill_tokens, seed + 2)[0], 1)
        run.add("prefill", "vx AsyncLLM", t[0])
        if hf:
            step("decode and prefill", "HF")
            _attempt(run, "HF", "transformers", lambda: _hf_round(run, ns, hf, seed + 3))
        step("concurrent", "vx AsyncLLM")
        seconds = await stream_all(allm, run.prompts(ns.concurrent, PROMPT_TOKENS, seed + 4), ns.concurrent_tokens)
        run.add("concurrent", "vx AsyncLLM", ns.concurrent * ns.concurrent_tokens / seconds)
        settle(allm, "any decode graph the run queued")  # its compile must not run beside the next engine
        if llama_dir:
            step("concurrent", "llama-server")
            await _attempt_async(run, "llama.cpp", "llama-server",
                                 _llama_concurrent(run, ns, llama_dir, seed + 4))


def _attempt(run: ShapeRun, engine: str, program: str, fn: Any) -> None:
    """Run `fn`; a failure of a competitor's `program` is noted for its column, and the run goes on."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported in the table's notes
        run.failures[engine] = f"{program}: {type(e).__name__}: {e}"


async def _attempt_async(run: ShapeRun, engine: str, program: str, coro: Any) -> None:
    """As `_attempt`, for a coroutine."""
    try:
        await coro
    except Exception as e:  # noqa: BLE001 - reported in the table's notes
        run.failures[engine] = f"{program}: {type(e).__name__}: {e}"


async def _llama_memory(run: ShapeRun, ns: argparse.Namespace, llama_dir: str) -> None:
    """llama-server's RSS at `-c context -np 1` after the two warm-up requests vx served."""
    print(f"{run.name}: llama-server at -c {ns.context} -np 1, for its memory ...", file=sys.stderr, flush=True)
    with llama.LlamaServer(llama_dir, run.gguf, ns.threads, 1, ns.context) as server:
        await server.complete_all(run.prompts(1, PROMPT_TOKENS, -1), WARMUP_TOKENS)
        await server.complete_all(run.prompts(1, ns.prefill_tokens, -2), 1)
        run.add("rss_context", "llama.cpp", server.rss_bytes())
        run.facts["llama_memory_cmd"] = server.describe()


def _llama_bench(run: ShapeRun, ns: argparse.Namespace, llama_dir: str) -> None:
    got = llama.llama_bench(llama_dir, run.gguf, ns.threads, ns.prefill_tokens, ns.decode_tokens)
    run.add("decode", "llama.cpp", got["decode_tok_s"])
    run.add("prefill", "llama.cpp", got["prefill_s"])


async def _llama_concurrent(run: ShapeRun, ns: argparse.Namespace, llama_dir: str, seed: int) -> None:
    context = ns.concurrent * (PROMPT_TOKENS + ns.concurrent_tokens + 16)
    with llama.LlamaServer(llama_dir, run.gguf, ns.threads, ns.concurrent, context) as server:
        await server.complete_all(run.prompts(ns.concurrent, PROMPT_TOKENS, -4), WARMUP_TOKENS)
        seconds = await server.complete_all(run.prompts(ns.concurrent, PROMPT_TOKENS, seed), ns.concurrent_tokens)
        run.add("concurrent", "llama.cpp", ns.concurrent * ns.concurrent_tokens / seconds)
        run.add("rss_concurrent", "llama.cpp", server.rss_bytes())
        run.facts["llama_concurrent_cmd"] = server.describe()


def _hf_round(run: ShapeRun, ns: argparse.Namespace, hf: dict[str, str], seed: int) -> None:
    spec = dict(engine=f"hf-{hf['dtype']}", model=hf["dir"], model_dir=hf["dir"], dtype=hf["dtype"], device="cpu",
                threads=ns.threads, prompt_tokens=ns.prefill_tokens, decode_tokens=ns.decode_tokens,
                decode_prompt_tokens=min(PROMPT_TOKENS, ns.prefill_tokens), token_range=run.token_range, seed=seed)
    got = run_child("benchmarks.latency", ["--child", json.dumps(spec)], ns.threads)
    if isinstance(got, str):
        raise RuntimeError(got)
    run.add("decode", "HF", got["decode_tok_s"])
    run.add("prefill", "HF", got["ttft_s"])


def prepare_hf(gguf: str, params: int, ns: argparse.Namespace) -> tuple[dict[str, str], str | None]:
    """The Hugging Face copy to run ({"dir", "dtype"}), or why HF is skipped: --hf-dtype none, or too little memory
    for transformers to dequantize the file (float32) beside the copy's dtype."""
    import psutil

    from vx.platform import cpu_has_native_bf16

    if ns.hf_dtype == "none":
        return {}, "skipped (--hf-dtype none)"
    dtype = ns.hf_dtype if ns.hf_dtype != "auto" else ("bfloat16" if cpu_has_native_bf16() else "float32")
    need = params * (4 + (2 if dtype == "bfloat16" else 4))
    available = psutil.virtual_memory().available
    if need > 0.8 * available:
        return {}, (f"skipped: dequantizing {params / 1e9:.1f}B weights needs ~{need / 2**30:.0f} GiB, "
                    f"{available / 2**30:.0f} GiB available")
    print(f"HF: the file dequantized to {dtype} by transformers (once)...", file=sys.stderr, flush=True)
    got = run_child("benchmarks.vs_llama_cpp", ["--float-copy", gguf, dtype], ns.threads)
    if isinstance(got, str):
        return {}, f"could not be loaded: {got}"
    return {"dir": got["dir"], "dtype": dtype}, None


# ---------------------------------------------------------------------------------------------------- report
def _median(run: ShapeRun, what: str, engine: str) -> float:
    values = run.samples.get((what, engine))
    return statistics.median(values) if values else float("nan")


def _cell(run: ShapeRun, what: str, engine: str, scale: float = 1.0) -> str:
    """`median (spread)` of a measure, or why there is none."""
    values = run.samples.get((what, engine))
    if not values:
        if engine in run.missing:
            return run.missing[engine].split(":")[0]
        return "failed" if engine in run.failures else "-"
    med = statistics.median(values)
    text = f"{med * scale:,.0f}" if abs(med * scale) >= 100 else f"{med * scale:.3g}"
    return text + (f" ({(max(values) - min(values)) / med:.0%})" if len(values) > 1 else "")


def report(run: ShapeRun, label: str, ns: argparse.Namespace, bandwidth: float, load_before: str) -> Table:
    """The shape's table: a row per measure, a column per engine, vx AsyncLLM's ratios to llama.cpp and HF."""
    from benchmarks.batch_throughput import kv_bytes_per_token
    from benchmarks.latency import gguf_weight_types

    f = run.facts
    vx, llm, lc, hf = ENGINES
    table = Table(f"{run.name}: {label}; {ns.threads} threads",
                  ["measure", vx, llm, lc, hf, "vx / llama.cpp", "vx / HF"])

    def speeds(what: str, title: str, engines: tuple[str, ...], scale: float = 1.0, time_like: bool = False) -> None:
        """A row of `engines`' figures ("-" in the others' columns) and vx's speed ratios to llama.cpp and HF."""
        def speed_ratio(other: str) -> str:
            a, b = _median(run, what, vx), _median(run, what, other)
            if other not in engines or math.isnan(b):
                return "-"
            return ratio(b, a) if time_like else ratio(a, b)

        table.add(title, *(_cell(run, what, e, scale) if e in engines else "-" for e in ENGINES),
                  speed_ratio(lc), speed_ratio(hf))

    speeds("decode", "batch-1 decode, tok/s", ENGINES)
    speeds("prefill", f"prefill {ns.prefill_tokens} tokens, ms", (vx, lc, hf), 1000.0, time_like=True)
    speeds("concurrent", f"{ns.concurrent} requests x {ns.concurrent_tokens} tokens, tok/s", (vx, lc))
    for what, title in (("rss_context", f"RSS at a {ns.context}-token context, MiB"),
                        ("rss_concurrent", "RSS after the concurrent runs, MiB")):
        table.add(title, _cell(run, what, vx, 1 / MIB), "-", _cell(run, what, lc, 1 / MIB), "-",
                  ratio(_median(run, what, vx), _median(run, what, lc)), "-")
    step_vx, step_file = f["vx_step_bytes"], f["file_step_bytes"]
    table.add("weights a decode step reads, MiB", f"{step_vx / MIB:,.1f}", f"{step_vx / MIB:,.1f}",
              f"{step_file / MIB:,.1f} (file)", "-", ratio(step_vx, step_file), "-")
    fractions = [step_vx * _median(run, "decode", vx), step_vx * _median(run, "decode", llm),
                 step_file * _median(run, "decode", lc)]
    table.add("batch-1 decode, fraction of read bandwidth",
              *(f"{x / (bandwidth * 1e9):.0%}" if not math.isnan(x) else "-" for x in fractions), "-",
              ratio(fractions[0], fractions[2]), "-")
    kv_vx = ns.context * kv_bytes_per_token(run.model_dir, f["vx_dtype"])
    kv_lc = ns.context * kv_bytes_per_token(run.model_dir, "float16")
    table.notes.append(f"Medians of {ns.rounds} interleaved rounds (spread: (max - min) / median). Machine: "
                       f"{machine_description()}; load average {load_before} before, {_load()} after; read "
                       f"bandwidth {bandwidth:.1f} GB/s (torch.sum over {ns.bandwidth_gib:g} GiB, {ns.threads} "
                       "threads, best of 5).")
    table.notes.append(f"File: {os.path.basename(run.gguf)}, {gguf_weight_types(run.gguf)}; tensors "
                       f"{f['file_bytes'] / MIB:,.0f} MiB, {f['params'] / 1e9:.2f}B weights. Floor at a {ns.context}-"
                       f"token context: tensors + KV = {(f['file_bytes'] + kv_vx) / MIB:,.0f} MiB for vx "
                       f"({f['vx_dtype']} KV), {(f['file_bytes'] + kv_lc) / MIB:,.0f} MiB for llama.cpp (f16 KV).")
    a = f["engine_args"]
    table.notes.append(f"vx: {f['vx_dtype']}, GGUF tensors kept quantized; max_model_len {a['max_model_len']}, "
                       f"num_kv_blocks {a['num_kv_blocks']} of {a['block_size']} (KV pages become resident as they "
                       f"are written); RSS: the AsyncLLM engine process (a bare `import torch` process holds "
                       f"{f['bare_torch_rss'] / MIB:.0f} MiB of it). Weights a decode step reads: vx's as held, the "
                       "file's as stored (the token embedding counted only where the head is tied to it).")
    if "llama_memory_cmd" in f or "llama_concurrent_cmd" in f:
        table.notes.append(f"llama.cpp: `llama-bench -t {ns.threads} -p {ns.prefill_tokens} -n {ns.decode_tokens} "
                           f"-r 1`; memory: `{f.get('llama_memory_cmd', '-')}`; concurrent: "
                           f"`{f.get('llama_concurrent_cmd', '-')}` (started and warmed up each round).")
    table.notes += [f"{e}: {why}" for e, why in run.missing.items()]
    table.notes += [f"{e} failed: {why}" for e, why in run.failures.items()]
    table.notes += run.notes
    return table


def summary(runs: list[ShapeRun], bandwidth: float) -> Table:
    """vx AsyncLLM's ratios to llama.cpp (and HF's decode) per shape, and each engine's share of the bandwidth."""
    vx, _, lc, hf = ENGINES
    table = Table("vx AsyncLLM beside llama.cpp, per shape (above 1: vx faster; memory: below 1, vx smaller)",
                  ["shape", "decode", "prefill", "concurrent", "RSS at the context", "vx bandwidth",
                   "llama.cpp bandwidth", "decode vs HF"])
    for run in runs:
        m = {(w, e): _median(run, w, e) for w, e in run.samples}
        get = lambda w, e: m.get((w, e), float("nan"))  # noqa: E731
        bw = [run.facts["vx_step_bytes"] * get("decode", vx), run.facts["file_step_bytes"] * get("decode", lc)]
        table.add(run.name, ratio(get("decode", vx), get("decode", lc)), ratio(get("prefill", lc), get("prefill", vx)),
                  ratio(get("concurrent", vx), get("concurrent", lc)),
                  ratio(get("rss_context", vx), get("rss_context", lc)),
                  *(f"{x / (bandwidth * 1e9):.0%}" if not math.isnan(x) else "-" for x in bw),
                  ratio(get("decode", vx), get("decode", hf)))
    return table


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vx bench vs_llama_cpp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="default,1.7b,8b", help="comma-separated, of default, 1.7b, 8b, tiny")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every measure (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of every engine (default 2)")
    ap.add_argument("--llama-cpp-bin", default=None,
                    help=f"llama.cpp's build folder with llama-bench and llama-server (default: ${llama.BIN_ENV}, "
                         f"else {llama.EXAMPLE_BIN_DIR})")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--concurrent", type=int, default=32, help="requests sent at once")
    ap.add_argument("--concurrent-tokens", type=int, default=128, help="new tokens of each concurrent request")
    ap.add_argument("--context", type=int, default=4096, help="vx's max_model_len; llama-server's -c for memory")
    ap.add_argument("--hf-dtype", default="auto", choices=["auto", "bfloat16", "float32", "none"],
                    help="Hugging Face's dtype (auto: bfloat16 where the CPU multiplies it, else float32; none: skip)")
    ap.add_argument("--bandwidth-gib", type=float, default=1.0, help="size of the read-bandwidth buffer")
    ap.add_argument("--seed", type=int, default=0, help="the random files' seed")
    ap.add_argument("--float-copy", nargs=2, default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.float_copy:
        from benchmarks.gguf_memory import float_copy

        print("RESULT " + json.dumps({"dir": float_copy(*ns.float_copy)}), flush=True)
        return
    if ns.rounds < 1 or ns.decode_tokens < 1 or ns.prefill_tokens < 1 or ns.concurrent < 1:
        ap.error("rounds, token counts and requests must be >= 1")
    if ns.context < max(ns.prefill_tokens + 1, PROMPT_TOKENS + max(ns.decode_tokens + 1, ns.concurrent_tokens)):
        ap.error(f"--context must hold the prefill's prompt and a token, and a {PROMPT_TOKENS}-token prompt with the "
                 "decode's or a concurrent request's tokens")
    from vx.platform import prefer_openmp_wait_policy

    prefer_openmp_wait_policy()  # what a vx application's process gets, for vx.LLM's engine here and AsyncLLM's
    set_threads(ns.threads)
    quiet_logs()
    import anyio

    from vx.config.model_source import ensure_gguf_config

    load_before = _load()
    llama_dir = llama.bin_dir(ns.llama_cpp_bin)
    llama_missing = llama.missing(llama_dir)
    bandwidth = read_bandwidth(ns.bandwidth_gib)
    bare = bare_torch_rss()
    runs = []
    for name in [s.strip() for s in ns.shapes.split(",") if s.strip()]:
        gguf, label = shape_file(name, ns.seed)
        model_dir = ensure_gguf_config(gguf)
        run = ShapeRun(name, gguf, model_dir, token_range(gguf), facts={"bare_torch_rss": bare})
        run.facts["file_bytes"], run.facts["file_step_bytes"], run.facts["params"] = file_weight_bytes(gguf)
        if llama_missing:
            run.missing["llama.cpp"] = llama_missing
        hf, why = prepare_hf(gguf, run.facts["params"], ns)
        if why:
            run.missing["HF"] = why
        if name == "8b":
            run.notes.append("8b: Llama-3-8B's layers with the default tokenizer's 49152-token vocabulary (128256 in "
                             "Llama-3): its embedding and head are 2.6x smaller than the real model's.")
        anyio.run(run_shape, run, ns, None if llama_missing else llama_dir, hf)
        report(run, label, ns, bandwidth, load_before).print()
        runs.append(run)
    summary(runs, bandwidth).print()


if __name__ == "__main__":
    main()
