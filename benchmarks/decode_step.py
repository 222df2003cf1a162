"""Decode step: the time of one pure-decode engine step, per attention backend and KV-cache dtype, on the same batch.

    python -m benchmarks.decode_step                                 # 64 requests at context ~300
    python -m benchmarks.decode_step --batch 32 --context 512 --backends torch,cpu --profile
    python -m benchmarks.decode_step --backends cpu --kv-cache-dtypes auto,fp8_e4m3,int8

`--batch` requests with random `--context`-token prompts are prefilled, then decode steps are timed for each
variant (each backend in `--backends` with each dtype in `--kv-cache-dtypes`): `torch` gathers each context out of
the paged cache before SDPA, `cpu` reads it in place with vx's C kernel; `fp8_e4m3` / `int8` store the cache in 8
bits (decoded as it is read). Same model, same batch, one engine per variant, all alive at once in this process: the
variants take turns, `--steps` timed steps each per round (after 3 warm-up steps), for `--repeats` rounds, so that a
load that comes and goes on a shared machine touches them alike. The table gives each variant's median over the
rounds of its mean time per step, and the spread of those round means (min-max). `--profile` adds the top ops of
`torch.profiler` over 3 more steps (the C kernel is not an aten op, so it is missing there; its time is the step's
remainder).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Table, add_model_args, model_label, quiet_logs, ratio, resolve_bench_model, set_threads


def start_engine(model_dir: str, backend: str, kv_cache_dtype: str, args: argparse.Namespace) -> Any:
    """An LLMEngine with the batch prefilled and 3 decode steps done, ready to time."""
    import vx
    from vx.client.llm_engine import LLMEngine
    from vx.config import EngineArgs

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model_dir, dtype=args.dtype, device=args.device, attention_backend=backend,
        kv_cache_dtype=kv_cache_dtype, max_num_seqs=args.batch, max_num_batched_tokens=max(2048, args.context + 1),
        max_model_len=args.context + args.repeats * args.steps + 32, num_kv_blocks=_blocks_needed(args)))
    rng = random.Random(args.seed)
    vocab = engine.config.model_config.vocab_size
    params = vx.SamplingParams(max_tokens=args.repeats * args.steps + 10, ignore_eos=True, temperature=0.0)
    for i in range(args.batch):
        engine.add_request(str(i), [rng.randrange(1, vocab) for _ in range(args.context)], params)
    scheduler = engine.engine_core.engine_core.scheduler
    while len(scheduler.running) < args.batch or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    return engine


def _blocks_needed(args: argparse.Namespace) -> int:
    """Every request's whole context (blocks of 16 tokens, the default), and the null block: the same cache size in
    blocks for every variant."""
    return args.batch * -(-(args.context + args.repeats * args.steps + 32) // 16) + 1


def time_steps(engine: Any, steps: int) -> float:
    """Seconds per decode step over `steps` steps."""
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps


def profile_steps(engine: Any) -> str:
    """torch.profiler's top ops over 3 steps."""
    from torch.profiler import profile

    with profile() as prof:
        for _ in range(3):
            engine.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vx bench decode_step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--batch", type=int, default=64, help="decoding requests")
    ap.add_argument("--context", type=int, default=300, help="prompt tokens of each request")
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps per variant and round")
    ap.add_argument("--repeats", type=int, default=3, help="rounds: the variants take turns, --steps each")
    ap.add_argument("--backends", default="torch,cpu", help="attention backends to compare, the first is the base")
    ap.add_argument("--kv-cache-dtypes", default="auto",
                    help="KV-cache dtypes to compare (auto, fp8_e4m3, int8), the first is the base")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's top ops per variant")
    args = ap.parse_args(argv)
    quiet_logs()
    set_threads(args.threads)
    model_dir = resolve_bench_model(args.model)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    kv_dtypes = [k.strip() for k in args.kv_cache_dtypes.split(",") if k.strip()]
    variants = [(b, k) for b in backends for k in kv_dtypes]
    names = {v: v[0] if len(kv_dtypes) == 1 else f"{v[0]}, kv {v[1]}" for v in variants}
    engines = {v: start_engine(model_dir, *v, args) for v in variants}
    try:
        rounds: dict[tuple[str, str], list[float]] = {v: [] for v in variants}
        for r in range(args.repeats):
            # Each round starts one variant later: none always runs first (or right after the same neighbour).
            for v in variants[r % len(variants):] + variants[:r % len(variants)]:
                rounds[v].append(time_steps(engines[v], args.steps))
        if args.profile:
            for v in variants:
                print(f"#### torch.profiler, {names[v]}\n\n```\n{profile_steps(engines[v])}```\n", flush=True)
        kv_bytes = {v: engines[v].engine_core.engine_core.executor.worker.model_runner.kv_cache_bytes_per_block()
                    // engines[v].config.cache_config.block_size for v in variants}
    finally:
        for engine in engines.values():
            engine.shutdown()
    base = statistics.median(rounds[variants[0]])
    table = Table(f"Decode step: {model_label(args.model, model_dir)}, {args.dtype}, batch {args.batch}, "
                  f"context ~{args.context}",
                  ["variant", "ms per step", "spread (ms)", "tok/s", "KV bytes/token", f"vs {names[variants[0]]}"])
    for v in variants:
        med = statistics.median(rounds[v])
        table.add(names[v], med * 1000, f"{min(rounds[v]) * 1000:.1f}-{max(rounds[v]) * 1000:.1f}",
                  args.batch / med, kv_bytes[v], ratio(base, med))
    table.notes.append(f"median over {args.repeats} rounds of {args.steps} steps (after 3 warm-up steps); spread: "
                       "the rounds' min-max; the variants take turns within each round, one engine each, in this "
                       "process; 'vs' > 1x is faster than the base")
    table.print()


if __name__ == "__main__":
    main()
