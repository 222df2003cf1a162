"""Prefix caching: time to first token of requests that share a long prefix, caching on beside off.

    python -m benchmarks.prefix_caching                 # quick: 8 requests, 256-token shared prefix
    python -m benchmarks.prefix_caching --full          # the issue's: 32 requests, 1,000-token prefix
    python -m benchmarks.prefix_caching --model micro --num-requests 4 --prefix-len 64

`--num-requests` requests = one shared prefix of `--prefix-len` random tokens + a distinct suffix of
`--suffix-len` tokens, each generating `--output-len` tokens (greedy, EOS ignored). They all arrive at once
at an in-process `vx.LLMEngine` (output_kind DELTA), stepped by hand; a request's time to first token (TTFT)
is the time from the burst to its first output. The same requests run on two engines in the same process,
`enable_prefix_caching=True` and `False`, each after a warm-up request with an unrelated prompt.
Prints TTFT mean / p50 / p90 / max, the prefix-cache hit rate, and the speed-up of caching.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (Table, add_model_args, model_label, percentile, prompt_token_range, quiet_logs,
                               ratio, resolve_bench_model, resolve_device, set_threads)

QUICK = dict(num_requests=8, prefix_len=256)
FULL = dict(num_requests=32, prefix_len=1000)


@dataclass
class BurstResult:
    """TTFTs (seconds, per request in submission order) and totals of one engine's run."""

    ttfts: list[float]
    total_seconds: float
    hit_tokens: int
    queried_tokens: int

    @property
    def mean_ttft(self) -> float:
        return sum(self.ttfts) / len(self.ttfts)


def shared_prefix_prompts(num_requests: int, prefix_len: int, suffix_len: int, token_range: tuple[int, int],
                          seed: int = 0) -> list[list[int]]:
    """One random prefix, then a random suffix per request (the first suffix token differs between any two)."""
    rng = random.Random(seed)
    lo, hi = token_range
    prefix = [rng.randrange(lo, hi) for _ in range(prefix_len)]
    firsts = rng.sample(range(lo, hi), num_requests) if hi - lo >= num_requests else [lo] * num_requests
    return [prefix + [f] + [rng.randrange(lo, hi) for _ in range(suffix_len - 1)] for f in firsts]


def run_burst(model_dir: str, prompts: list[list[int]], output_len: int, caching: bool, dtype: str, device: str,
              warm_prompt: list[int], **engine_args: Any) -> BurstResult:
    """Submit every prompt at once to a fresh in-process engine and record each request's first output."""
    import vx

    args = vx.EngineArgs(model=model_dir, dtype=dtype, device=device, enable_prefix_caching=caching,
                         **engine_args)
    engine = vx.LLMEngine.from_engine_args(args)
    try:
        params = vx.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                                   output_kind=vx.RequestOutputKind.DELTA)
        engine.add_request("warm-up", warm_prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        before = engine.stats()
        first: dict[str, float] = {}
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                if out.request_id not in first and out.outputs and out.outputs[0].token_ids:
                    first[out.request_id] = now - t0
        total = time.perf_counter() - t0
        stats = engine.stats()
    finally:
        engine.shutdown()
    return BurstResult([first[f"r{i}"] for i in range(len(prompts))], total,
                       stats.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens,
                       stats.prefix_cache_queried_tokens - before.prefix_cache_queried_tokens)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vx bench prefix_caching", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--full", action="store_true", help="the issue's sizes: 32 requests, 1,000-token prefix")
    ap.add_argument("--num-requests", type=int, default=None, help=f"default {QUICK['num_requests']} "
                    f"({FULL['num_requests']} with --full)")
    ap.add_argument("--prefix-len", type=int, default=None, help=f"default {QUICK['prefix_len']} "
                    f"({FULL['prefix_len']} with --full)")
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="vx engine argument")
    args = ap.parse_args(argv)
    quiet_logs()
    set_threads(args.threads)
    sizes = FULL if args.full else QUICK
    n = args.num_requests or sizes["num_requests"]
    prefix_len = args.prefix_len or sizes["prefix_len"]
    if n < 1 or prefix_len < 1 or args.suffix_len < 1 or args.output_len < 1:
        ap.error("sizes must be positive")
    device = resolve_device(args.device)
    model_dir = resolve_bench_model(args.model)
    token_range = prompt_token_range(model_dir)
    prompts = shared_prefix_prompts(n, prefix_len, args.suffix_len, token_range, args.seed)
    warm = shared_prefix_prompts(1, 32, 8, token_range, args.seed + 1)[0]
    label = model_label(args.model, model_dir)
    print(f"prefix caching: {label}, {args.dtype}, {device}; {n} requests x ({prefix_len} shared + "
          f"{args.suffix_len} own) prompt tokens, {args.output_len} generated\n", flush=True)

    engine_args: dict[str, Any] = {"max_model_len": prefix_len + args.suffix_len + args.output_len + 16,
                                   "max_num_seqs": max(n, 1)}
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    results: dict[bool, BurstResult] = {}
    for caching in (False, True):
        results[caching] = run_burst(model_dir, prompts, args.output_len, caching, args.dtype, device, warm,
                                     **engine_args)
        gc.collect()

    t = Table(f"Time to first token, {n} requests sharing a {prefix_len}-token prefix ({label}, {device})",
              ["prefix caching", "TTFT mean ms", "p50 ms", "p90 ms", "max ms", "all done s", "hit rate",
               "mean TTFT speed-up"])
    for caching in (True, False):
        r = results[caching]
        hit = f"{100 * r.hit_tokens / r.queried_tokens:.0f}%" if r.queried_tokens else "-"
        t.add("on" if caching else "off", r.mean_ttft * 1e3, percentile(r.ttfts, 50) * 1e3,
              percentile(r.ttfts, 90) * 1e3, max(r.ttfts) * 1e3, r.total_seconds, hit,
              ratio(results[False].mean_ttft, r.mean_ttft))
    t.notes.append("all requests arrive at once; TTFT from the burst to each request's first token; "
                   "greedy, in-process LLMEngine stepped by hand")
    t.print()


if __name__ == "__main__":
    main()
