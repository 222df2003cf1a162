"""Decode step: the time of one pure-decode engine step, per attention backend and KV-cache dtype, on the same batch.

    python -m benchmarks.decode_step                                 # 64 requests at context ~300
    python -m benchmarks.decode_step --batch 32 --context 512 --backends torch,cpu --profile
    python -m benchmarks.decode_step --backends cpu --kv-cache-dtypes auto,fp8_e4m3,int8
    python -m benchmarks.decode_step --batch 1 --backends cpu --modes eager,compiled --breakdown
    python -m benchmarks.decode_step --backends auto --batch 1,8,16,32,64   # where tokens/s stops growing
    python -m benchmarks.decode_step --backends cpu --modes compiled --batch 1,32,64 --cpu-matmuls float,int8

`--batch` requests with random `--context`-token prompts are prefilled, then decode steps are timed for each
variant (each backend in `--backends` with each dtype in `--kv-cache-dtypes`, each mode in `--modes` and each batch
size in `--batch`, and each of `--cpu-matmuls`: VX_CPU_MATMUL while the engine loads, the quantized weights'
float or int8-activation path): `torch` gathers each context out of
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

from benchmarks.common import (Table, add_model_args, engine_model_runner, model_label, parse_int_list, quiet_logs,
                               ratio, resolve_bench_model, set_threads)


def start_engine(model_dir: str, backend: str, kv_cache_dtype: str, mode: str, batch: int, cpu_matmul: str,
                 args: argparse.Namespace) -> Any:
    """An LLMEngine with `batch` requests prefilled and 3 decode steps done, ready to time; in `compiled` mode, with
    the decode graph of the batch's size compiled."""
    import vx
    from vx.client.llm_engine import LLMEngine
    from vx.config import EngineArgs

    saved = {name: os.environ.get(name) for name in ("VX_DECODE_COMPILE", "VX_CPU_MATMUL")}
    os.environ["VX_DECODE_COMPILE"] = "background"  # the one size timed is compiled below
    if cpu_matmul:
        os.environ["VX_CPU_MATMUL"] = cpu_matmul  # read as the weights are packed, at load
    try:
        engine = LLMEngine.from_engine_args(EngineArgs(
            model=model_dir, dtype=args.dtype, device=args.device, attention_backend=backend,
            kv_cache_dtype=kv_cache_dtype, max_num_seqs=batch,
            max_num_batched_tokens=max(2048, args.context + 1),
            max_model_len=args.context + args.repeats * args.steps + 32 + _BREAKDOWN_STEPS,
            num_kv_blocks=_blocks_needed(batch, args), enforce_eager=mode == "eager"))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    graphs = engine_model_runner(engine).decode_graphs
    if mode == "compiled":
        if graphs is None:
            raise SystemExit(f"backend {backend} has no compiled decode here")
        graphs.wait()
        graphs.compile_now([graphs.sizes[-1]])
    rng = random.Random(args.seed)
    vocab = engine.config.model_config.vocab_size
    params = vx.SamplingParams(max_tokens=args.repeats * args.steps + 10 + _BREAKDOWN_STEPS, ignore_eos=True,
                               temperature=0.0)
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(1, vocab) for _ in range(args.context)], params)
    scheduler = engine.engine_core.engine_core.scheduler
    while len(scheduler.running) < batch or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    return engine


_BREAKDOWN_STEPS = 10


def _blocks_needed(batch: int, args: argparse.Namespace) -> int:
    """Every request's whole context (blocks of 16 tokens, the default), and the null block: the same cache size in
    blocks for every variant of one batch size."""
    return batch * -(-(args.context + args.repeats * args.steps + 32 + _BREAKDOWN_STEPS) // 16) + 1


def time_steps(engine: Any, steps: int) -> float:
    """Seconds per decode step over `steps` steps."""
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps


BREAKDOWN_PARTS = ("layers' quantized matmuls", "LM head", "attention kernel", "rest of forward",
                   "sampling", "engine outside the model")


def step_breakdown(engine: Any, steps: int) -> dict[str, float]:
    """Seconds per step of each of BREAKDOWN_PARTS over `steps` steps, timed around the calls that make them.

    The calls are wrapped on this engine's objects (and the two kernel classes) for these steps only.
    """
    from vx.gpu.attention.cpu_kernels import PagedDecodeKernel
    from vx.kernels.quant_matmul import QuantMatmulKernel

    runner = engine_model_runner(engine)
    spent = dict.fromkeys(("matmul", "head", "attention", "forward", "sampling"), 0.0)
    in_head = [False]

    def timed(key: str, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t0
        return call

    def matmul(self: Any, x: Any, w: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return plain_matmul(self, x, w, *args, **kwargs)
        finally:
            if not in_head[0]:
                spent["matmul"] += time.perf_counter() - t0

    def head(hidden: Any) -> Any:
        in_head[0] = True
        try:
            return timed("head", plain_head)(hidden)
        finally:
            in_head[0] = False

    plain_matmul, plain_attention = QuantMatmulKernel.matmul, PagedDecodeKernel.__call__
    plain_head = runner.model.compute_logits
    QuantMatmulKernel.matmul = matmul
    PagedDecodeKernel.__call__ = timed("attention", plain_attention)
    runner.model.compute_logits = head
    runner._forward = timed("forward", runner._forward)
    runner._sample = timed("sampling", runner._sample)
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - t0
    finally:
        QuantMatmulKernel.matmul, PagedDecodeKernel.__call__ = plain_matmul, plain_attention
        for name in ("compute_logits",):
            runner.model.__dict__.pop(name, None)
        for name in ("_forward", "_sample"):
            runner.__dict__.pop(name, None)
    parts = [spent["matmul"], spent["head"], spent["attention"],
             spent["forward"] - spent["matmul"] - spent["attention"], spent["sampling"],
             total - spent["forward"] - spent["head"] - spent["sampling"]]
    return {name: value / steps for name, value in zip(BREAKDOWN_PARTS, parts)}


def profile_steps(engine: Any) -> str:
    """torch.profiler's top ops over 3 steps."""
    from torch.profiler import profile

    with profile() as prof:
        for _ in range(3):
            engine.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vx bench decode_step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--batch", type=parse_int_list, default=[64],
                    help="decoding requests; several (1,8,64) time each batch size as a variant")
    ap.add_argument("--context", type=int, default=300, help="prompt tokens of each request")
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps per variant and round")
    ap.add_argument("--repeats", type=int, default=3, help="rounds: the variants take turns, --steps each")
    ap.add_argument("--backends", default="torch,cpu", help="attention backends to compare, the first is the base")
    ap.add_argument("--kv-cache-dtypes", default="auto",
                    help="KV-cache dtypes to compare (auto, fp8_e4m3, int8), the first is the base")
    ap.add_argument("--modes", default="eager", help="eager and/or compiled (decode graphs), e.g. eager,compiled")
    ap.add_argument("--cpu-matmuls", default="",
                    help="VX_CPU_MATMUL values to compare (float, int8, auto), the first is the base (default: "
                         "as the environment says)")
    ap.add_argument("--breakdown", action="store_true",
                    help="print where each variant's step goes (matmuls, LM head, attention, rest, sampling, engine)")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's top ops per variant")
    args = ap.parse_args(argv)
    quiet_logs()
    set_threads(args.threads)
    model_dir = resolve_bench_model(args.model)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    kv_dtypes = [k.strip() for k in args.kv_cache_dtypes.split(",") if k.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not set(modes) <= {"eager", "compiled"}:
        ap.error(f"--modes: eager and/or compiled, got {args.modes!r}")
    matmuls = [c.strip() for c in args.cpu_matmuls.split(",") if c.strip()] or [""]
    variants = [(b, k, m, n, c) for b in backends for k in kv_dtypes for m in modes for n in args.batch
                for c in matmuls]
    names = {v: ", ".join([v[0]] + ([f"kv {v[1]}"] if len(kv_dtypes) > 1 else []) + ([v[2]] if len(modes) > 1 else [])
                          + ([f"batch {v[3]}"] if len(args.batch) > 1 else [])
                          + ([f"{v[4]} matmul"] if len(matmuls) > 1 else [])) for v in variants}
    engines = {v: start_engine(model_dir, *v, args) for v in variants}
    try:
        rounds: dict[tuple[str, str, str, int, str], list[float]] = {v: [] for v in variants}
        for r in range(args.repeats):
            # Each round starts one variant later: none always runs first (or right after the same neighbour).
            for v in variants[r % len(variants):] + variants[:r % len(variants)]:
                rounds[v].append(time_steps(engines[v], args.steps))
        breakdowns = {v: step_breakdown(engines[v], _BREAKDOWN_STEPS) for v in variants} if args.breakdown else {}
        if args.profile:
            for v in variants:
                print(f"#### torch.profiler, {names[v]}\n\n```\n{profile_steps(engines[v])}```\n", flush=True)
        kv_bytes = {v: engine_model_runner(engines[v]).kv_cache_bytes_per_block()
                    // engines[v].config.cache_config.block_size for v in variants}
    finally:
        for engine in engines.values():
            engine.shutdown()
    base = statistics.median(rounds[variants[0]])
    batches = ",".join(map(str, args.batch))
    table = Table(f"Decode step: {model_label(args.model, model_dir)}, {args.dtype}, batch {batches}, "
                  f"context ~{args.context}",
                  ["variant", "ms per step", "spread (ms)", "tok/s", "KV bytes/token", f"vs {names[variants[0]]}"])
    for v in variants:
        med = statistics.median(rounds[v])
        # tokens/s against the base's: the same as its step time against this one's when the batches are equal.
        table.add(names[v], med * 1000, f"{min(rounds[v]) * 1000:.1f}-{max(rounds[v]) * 1000:.1f}",
                  v[3] / med, kv_bytes[v], ratio(v[3] / med, variants[0][3] / base))
    table.notes.append(f"median over {args.repeats} rounds of {args.steps} steps (after 3 warm-up steps); spread: "
                       "the rounds' min-max; the variants take turns within each round, one engine each, in this "
                       "process; 'vs': tokens/s against the base's (> 1x: faster)")
    table.print()
    if breakdowns:
        parts = Table(f"Where a step goes (ms per step, mean of {_BREAKDOWN_STEPS} steps)",
                      ["part"] + [names[v] for v in variants])
        for part in BREAKDOWN_PARTS:
            parts.add(part, *[breakdowns[v][part] * 1000 for v in variants])
        parts.add("total", *[sum(breakdowns[v].values()) * 1000 for v in variants])
        parts.notes.append("rest of forward: the model's other ops (norms, rotary, KV writes, activations, float "
                           "matmuls) and their Python; in a compiled graph, everything but vx's kernels")
        parts.print()


if __name__ == "__main__":
    main()
