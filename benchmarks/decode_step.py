"""Decode step: the time of one pure-decode engine step, per attention backend, on the same batch.

    python -m benchmarks.decode_step                                 # 64 requests at context ~300
    python -m benchmarks.decode_step --batch 32 --context 512 --backends torch,cpu --profile

`--batch` requests with random `--context`-token prompts are prefilled, then `--steps` decode steps are timed
(after 3 warm-up steps) for each backend in `--backends`: `torch` gathers each context out of the paged cache
before SDPA, `cpu` reads it in place with vx's C kernel. Same model, same batch, one engine per backend, run one
after the other in this process. `--profile` adds the top ops of `torch.profiler` over 3 more steps (the C
kernel is not an aten op, so it is missing there; its time is the step's remainder).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Table, add_model_args, model_label, quiet_logs, ratio, resolve_bench_model, set_threads


def time_backend(model_dir: str, backend: str, args: argparse.Namespace) -> tuple[float, str | None]:
    """Seconds per decode step with `backend`, and the profiler's table when asked for."""
    import vx
    from vx.client.llm_engine import LLMEngine
    from vx.config import EngineArgs

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model_dir, dtype=args.dtype, device=args.device, attention_backend=backend,
        max_num_seqs=args.batch, max_num_batched_tokens=max(2048, args.context + 1)))
    try:
        rng = random.Random(args.seed)
        vocab = engine.config.model_config.vocab_size
        params = vx.SamplingParams(max_tokens=args.steps + 10, ignore_eos=True, temperature=0.0)
        for i in range(args.batch):
            engine.add_request(str(i), [rng.randrange(1, vocab) for _ in range(args.context)], params)
        scheduler = engine.engine_core.engine_core.scheduler
        while len(scheduler.running) < args.batch or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
            engine.step()
        for _ in range(3):
            engine.step()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        per_step = (time.perf_counter() - t0) / args.steps
        table = None
        if args.profile:
            from torch.profiler import profile

            with profile() as prof:
                for _ in range(3):
                    engine.step()
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8)
        return per_step, table
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vx bench decode_step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--batch", type=int, default=64, help="decoding requests")
    ap.add_argument("--context", type=int, default=300, help="prompt tokens of each request")
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps per backend")
    ap.add_argument("--backends", default="torch,cpu", help="attention backends to compare, the first is the base")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's top ops per backend")
    args = ap.parse_args(argv)
    quiet_logs()
    set_threads(args.threads)
    model_dir = resolve_bench_model(args.model)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    table = Table(f"Decode step: {model_label(args.model, model_dir)}, {args.dtype}, batch {args.batch}, "
                  f"context ~{args.context}", ["attention backend", "ms per step", "tok/s", f"vs {backends[0]}"])
    results = {}
    for backend in backends:
        per_step, prof = time_backend(model_dir, backend, args)
        results[backend] = per_step
        if prof:
            print(f"#### torch.profiler, {backend}\n\n```\n{prof}```\n", flush=True)
    for backend in backends:
        per_step = results[backend]
        table.add(backend, per_step * 1000, args.batch / per_step, ratio(results[backends[0]], per_step))
    table.notes.append(f"{args.steps} timed steps after 3 warm-up steps; one engine per backend, in this process")
    table.print()


if __name__ == "__main__":
    main()
