"""Streaming latency: TTFT and inter-token latency under Poisson arrivals, AsyncLLM beside the in-process engine.

    python -m benchmarks.streaming                               # 16 requests at 0.5 req/s, default model
    python -m benchmarks.streaming --rate 4 --num-requests 64 --backend trio
    python -m benchmarks.streaming --model micro --num-requests 4 --rate 20 --output-len 8

`--num-requests` requests (random token-id prompts of `--min-prompt-len`..`--max-prompt-len` tokens, each
generating exactly `--output-len` tokens, greedy) arrive as a Poisson process of `--rate` requests/s.

- AsyncLLM: one task per request sleeps until its arrival, then streams `llm.generate(...)` (DELTA outputs)
  from the background engine process (ZMQ, detokenization in this process), on asyncio or trio.
- in-process: the same arrival schedule fed to a `vx.LLMEngine` in this process by a plain loop that adds
  due requests between steps: the same scheduler and model without the process boundary and event loop,
  so the ratio is the cost of the async, multiprocess path.

Latencies are measured from each request's scheduled arrival. TTFT: arrival to first token. ITL: the gap
between successive token deliveries (an output carrying k tokens gives k gaps of a k-th of the time).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (Table, Workload, add_model_args, make_workload, model_label, percentile,
                               poisson_arrivals, prompt_token_range, quiet_logs, ratio, resolve_bench_model,
                               resolve_device, set_threads)


@dataclass
class Trace:
    """When one request was due and when its tokens came (perf_counter seconds)."""

    arrival: float
    times: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def record(self, t: float, n: int) -> None:
        if n:
            self.times.append(t)
            self.counts.append(n)

    @property
    def ttft(self) -> float:
        return self.times[0] - self.arrival

    def itls(self) -> list[float]:
        gaps: list[float] = []
        for prev, t, n in zip(self.times, self.times[1:], self.counts[1:]):
            gaps += [(t - prev) / n] * n
        return gaps


def summarize(traces: list[Trace], wall: float) -> dict[str, float]:
    """Latency percentiles (ms) and output tokens/s of one run."""
    ttfts = [t.ttft for t in traces]
    itls = [g for t in traces for g in t.itls()]
    e2e = [t.times[-1] - t.arrival for t in traces]
    tpot = [(t.times[-1] - t.times[0]) / (sum(t.counts) - 1) for t in traces if sum(t.counts) > 1]
    m: dict[str, float] = {}
    for q in (50, 90, 99):
        m[f"TTFT p{q} ms"] = percentile(ttfts, q) * 1e3
    for q in (50, 90, 99):
        m[f"ITL p{q} ms"] = percentile(itls, q) * 1e3
    m["TPOT mean ms"] = sum(tpot) / len(tpot) * 1e3 if tpot else float("nan")
    m["E2E p50 ms"] = percentile(e2e, 50) * 1e3
    m["output tok/s"] = sum(sum(t.counts) for t in traces) / wall
    return m


def _params(n: int) -> Any:
    import vx

    return vx.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, output_kind=vx.RequestOutputKind.DELTA)


async def _run_async(model_dir: str, wl: Workload, arrivals: list[float], engine_args: dict[str, Any],
                     result: dict[str, Any]) -> None:
    import anyio

    import vx

    async with vx.AsyncLLM(model_dir, **engine_args) as llm:
        await llm.complete(wl.prompts[0][:8], vx.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        start = time.perf_counter()
        traces = [Trace(start + a) for a in arrivals]

        async def one(i: int) -> None:
            await anyio.sleep(max(0.0, traces[i].arrival - time.perf_counter()))
            async for out in llm.generate(wl.prompts[i], _params(wl.output_lens[i])):
                traces[i].record(time.perf_counter(), len(out.outputs[0].token_ids) if out.outputs else 0)

        async with anyio.create_task_group() as tg:
            for i in range(len(wl)):
                tg.start_soon(one, i)
        result["traces"], result["wall"] = traces, time.perf_counter() - start


def run_async_llm(model_dir: str, wl: Workload, arrivals: list[float], engine_args: dict[str, Any],
                  backend: str = "asyncio") -> tuple[list[Trace], float]:
    """The workload through `vx.AsyncLLM` on an anyio event loop; returns (traces, wall seconds)."""
    import anyio

    result: dict[str, Any] = {}
    anyio.run(_run_async, model_dir, wl, arrivals, engine_args, result, backend=backend)
    return result["traces"], result["wall"]


def run_inproc(model_dir: str, wl: Workload, arrivals: list[float], engine_args: dict[str, Any]
               ) -> tuple[list[Trace], float]:
    """The same arrival schedule through an in-process `vx.LLMEngine`, added between steps."""
    import vx

    engine = vx.LLMEngine.from_engine_args(vx.EngineArgs(model=model_dir, **engine_args))
    try:
        engine.add_request("warm-up", wl.prompts[0][:8], _params(4))
        while engine.has_unfinished_requests():
            engine.step()
        start = time.perf_counter()
        traces = [Trace(start + a) for a in arrivals]
        index = {f"r{i}": i for i in range(len(wl))}
        nxt = 0
        while nxt < len(wl) or engine.has_unfinished_requests():
            now = time.perf_counter()
            while nxt < len(wl) and traces[nxt].arrival <= now:
                engine.add_request(f"r{nxt}", wl.prompts[nxt], _params(wl.output_lens[nxt]))
                nxt += 1
            if engine.has_unfinished_requests():
                outs = engine.step()
                t = time.perf_counter()
                for out in outs:
                    traces[index[out.request_id]].record(t, len(out.outputs[0].token_ids) if out.outputs else 0)
            elif nxt < len(wl):
                time.sleep(max(0.0, traces[nxt].arrival - time.perf_counter()))
        wall = time.perf_counter() - start
    finally:
        engine.shutdown()
    return traces, wall


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vx bench streaming", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--rate", type=float, default=0.5, help="Poisson arrival rate, requests/s (inf: all at once)")
    ap.add_argument("--min-prompt-len", type=int, default=16)
    ap.add_argument("--max-prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"], help="anyio backend")
    ap.add_argument("--no-inproc", action="store_true", help="skip the in-process comparison")
    args = ap.parse_args(argv)
    quiet_logs()
    set_threads(args.threads)
    device = resolve_device(args.device)
    model_dir = resolve_bench_model(args.model)
    wl = make_workload(args.num_requests, (args.min_prompt_len, args.max_prompt_len),
                       (args.output_len, args.output_len), prompt_token_range(model_dir), args.seed)
    arrivals = poisson_arrivals(len(wl), args.rate, args.seed)
    label = model_label(args.model, model_dir)
    print(f"streaming: {label}, {args.dtype}, {device}; {wl.describe()}; Poisson {args.rate} req/s "
          f"(last arrival at {arrivals[-1]:.1f} s)\n", flush=True)
    engine_args = dict(dtype=args.dtype, device=device, max_model_len=args.max_prompt_len + args.output_len + 16)

    runs: dict[str, dict[str, float]] = {}
    traces, wall = run_async_llm(model_dir, wl, arrivals, engine_args, args.backend)
    runs[f"AsyncLLM ({args.backend})"] = summarize(traces, wall)
    gc.collect()
    if not args.no_inproc:
        traces, wall = run_inproc(model_dir, wl, arrivals, engine_args)
        runs["in-process LLMEngine"] = summarize(traces, wall)

    names = list(runs)
    headers = ["metric"] + names + (["AsyncLLM / in-process"] if len(names) == 2 else [])
    t = Table(f"Streaming latency under Poisson arrivals ({label}, {args.rate} req/s, {len(wl)} requests)", headers)
    for metric in runs[names[0]]:
        values = [runs[n][metric] for n in names]
        t.add(metric, *values, *([ratio(values[0], values[1])] if len(values) == 2 else []))
    t.notes.append("latencies from each request's scheduled arrival; for tok/s a ratio above 1.00x favours "
                   "AsyncLLM, for latencies below 1.00x does")
    t.print()


if __name__ == "__main__":
    main()
