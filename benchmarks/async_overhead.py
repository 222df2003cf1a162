"""AsyncLLM overhead: time to first token and per-token latency over the process boundary, beside the
in-process engine (`LLMEngine` stepped in this thread) on the same requests, in one run.

    python -m benchmarks.async_overhead                      # random "tiny" model, CPU
    python -m benchmarks.async_overhead --model micro --num-requests 32 --output-len 128 --backend trio

Two scenarios: one request at a time (pure latency; each of `--sequential` requests alone), then
`--num-requests` at once. Per request: TTFT = first output - submission; per-token = (last output - first
output) / (tokens - 1). Both engines run greedy, EOS ignored, DELTA outputs, after a warm-up. The ratio
column is AsyncLLM / in-process (above 1.00x: the process boundary costs that much).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402 - after the path set-up above
    Table,
    Workload,
    add_model_args,
    make_workload,
    model_label,
    percentile,
    prompt_token_range,
    quiet_logs,
    ratio,
    resolve_bench_model,
    resolve_device,
    set_threads,
)


@dataclass
class Timing:
    """Per-request timestamps of one run (perf_counter seconds)."""

    submitted: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    last: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    wall: float = 0.0

    def add(self, submitted: float, first: float, last: float, tokens: int) -> None:
        self.submitted.append(submitted)
        self.first.append(first)
        self.last.append(last)
        self.tokens.append(tokens)

    def ttft_ms(self) -> list[float]:
        return [1000 * (f - s) for s, f in zip(self.submitted, self.first)]

    def per_token_ms(self) -> list[float]:
        return [1000 * (la - f) / (n - 1) for f, la, n in zip(self.first, self.last, self.tokens) if n > 1]

    def tokens_per_s(self) -> float:
        return sum(self.tokens) / self.wall if self.wall else float("nan")


def params_for(output_len: int) -> Any:
    import vx

    return vx.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                             output_kind=vx.RequestOutputKind.DELTA)


# ------------------------------------------------------------------------------------------- in-process
def run_inproc_batch(engine: Any, prompts: list[list[int]], output_len: int, tag: str) -> Timing:
    """All `prompts` submitted at once to an in-process LLMEngine, stepped to the end in this thread."""
    params = params_for(output_len)
    timing = Timing()
    start: dict[str, float] = {}
    first: dict[str, float] = {}
    count: dict[str, int] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        rid = f"{tag}-{i}"
        start[rid] = time.perf_counter()
        engine.add_request(rid, p, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            n = len(out.outputs[0].token_ids)
            if n:
                first.setdefault(out.request_id, now)
                count[out.request_id] = count.get(out.request_id, 0) + n
            if out.finished:
                timing.add(start[out.request_id], first[out.request_id], now, count[out.request_id])
    timing.wall = time.perf_counter() - t0
    return timing


def measure_inproc(model_dir: str, wl: Workload, output_len: int, sequential: int, engine_args: dict) -> dict:
    import vx

    engine = vx.LLMEngine.from_engine_args(vx.EngineArgs(model=model_dir, **engine_args))
    try:
        run_inproc_batch(engine, wl.prompts[:2], 4, "warm")
        single = Timing()
        for i, p in enumerate(wl.prompts[:sequential]):
            t = run_inproc_batch(engine, [p], output_len, f"seq{i}")
            single.add(t.submitted[0], t.first[0], t.last[0], t.tokens[0])
            single.wall += t.wall
        batch = run_inproc_batch(engine, wl.prompts, output_len, "batch")
    finally:
        engine.shutdown()
    return {"single": single, "batch": batch}


# ---------------------------------------------------------------------------------------------- AsyncLLM
async def _one(llm: Any, prompt: list[int], params: Any, timing: Timing) -> None:
    submitted = time.perf_counter()
    first = last = 0.0
    n = 0
    async for out in llm.generate(prompt, params):
        now = time.perf_counter()
        k = len(out.outputs[0].token_ids)
        if k and not n:
            first = now
        n += k
        last = now
    timing.add(submitted, first, last, n)


async def _measure_async(model_dir: str, wl: Workload, output_len: int, sequential: int,
                         engine_args: dict) -> dict:
    import anyio

    import vx

    params = params_for(output_len)
    async with vx.AsyncLLM(model_dir, **engine_args) as llm:
        await _one(llm, wl.prompts[0], params_for(4), Timing())  # warm-up
        await _one(llm, wl.prompts[1 % len(wl)], params_for(4), Timing())
        single = Timing()
        for p in wl.prompts[:sequential]:
            t0 = time.perf_counter()
            await _one(llm, p, params, single)
            single.wall += time.perf_counter() - t0
        batch = Timing()
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for p in wl.prompts:
                tg.start_soon(_one, llm, p, params, batch)
        batch.wall = time.perf_counter() - t0
    return {"single": single, "batch": batch}


def measure_async(model_dir: str, wl: Workload, output_len: int, sequential: int, engine_args: dict,
                  backend: str) -> dict:
    import anyio

    return anyio.run(_measure_async, model_dir, wl, output_len, sequential, engine_args, backend=backend)


# ------------------------------------------------------------------------------------------------ report
def report(label: str, inproc: dict, asyn: dict, wl: Workload, args: argparse.Namespace) -> Table:
    table = Table(f"AsyncLLM over the process boundary vs in-process engine: {label}, {args.dtype}, "
                  f"{args.device_resolved}",
                  ["scenario", "metric", "in-process", "AsyncLLM", "AsyncLLM - in-process", "ratio"])
    scenarios = (("1 request at a time", "single"), (f"{len(wl)} concurrent", "batch"))
    for name, key in scenarios:
        a, b = inproc[key], asyn[key]
        rows = [
            ("TTFT p50 (ms)", percentile(a.ttft_ms(), 50), percentile(b.ttft_ms(), 50)),
            ("TTFT mean (ms)", statistics.fmean(a.ttft_ms()), statistics.fmean(b.ttft_ms())),
            ("per-token mean (ms)", _mean(a.per_token_ms()), _mean(b.per_token_ms())),
            ("per-token p90 (ms)", percentile(a.per_token_ms(), 90), percentile(b.per_token_ms(), 90)),
            ("output tok/s", a.tokens_per_s(), b.tokens_per_s()),
        ]
        for metric, x, y in rows:
            table.add(name, metric, x, y, y - x, ratio(y, x))
    table.notes.append(f"workload: {wl.describe()}; output {args.output_len} tokens each, greedy, EOS ignored")
    table.notes.append(f"'1 request at a time': the first {args.sequential} requests, each alone; AsyncLLM on "
                       f"{args.backend}")
    table.notes.append(f"torch CPU threads: {args.threads or 'torch default'} "
                       "(on a busy CPU, --threads 1 gives steadier numbers)")
    table.notes.append("in-process: LLMEngine stepped in the caller's thread (what vx.LLM does); AsyncLLM: engine "
                       "in a spawned process, ZMQ ipc + msgpack, detokenized in an output task")
    return table


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vx bench async_overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, default_model="tiny")
    ap.add_argument("--num-requests", type=int, default=16, help="requests of the concurrent scenario")
    ap.add_argument("--sequential", type=int, default=4, help="requests of the one-at-a-time scenario")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"], help="AsyncLLM's event loop")
    args = ap.parse_args(argv)
    quiet_logs()
    set_threads(args.threads)
    args.device_resolved = resolve_device(args.device)
    model_dir = resolve_bench_model(args.model)
    wl = make_workload(args.num_requests, (args.prompt_len, args.prompt_len), (args.output_len, args.output_len),
                       prompt_token_range(model_dir), args.seed)
    args.sequential = max(1, min(args.sequential, len(wl)))
    engine_args = {"dtype": args.dtype, "device": args.device_resolved,
                   "max_model_len": args.prompt_len + args.output_len + 16}
    label = model_label(args.model, model_dir)
    print(f"async_overhead: {label}, {args.dtype}, {args.device_resolved}; {wl.describe()}\n", flush=True)

    inproc = measure_inproc(model_dir, wl, args.output_len, args.sequential, engine_args)
    gc.collect()
    asyn = measure_async(model_dir, wl, args.output_len, args.sequential, engine_args, args.backend)
    report(label, inproc, asyn, wl, args).print()


if __name__ == "__main__":
    main()
