"""One model, one workload, split several ways: the whole model in the engine's process (TP=1, "uni"), in one
worker process (TP=1 through the multiprocess executor: its cost alone), over 2 tensor-parallel ranks and over 2
pipeline stages (worker processes, gloo on the CPU).

    python -m benchmarks.parallel                                   # the `tiny` model, 16 requests
    python -m benchmarks.parallel --model qwen2.5-0.5b-random --layouts uni,2x1 --num-requests 32

Per layout: the mean engine step, tokens/s (output, and prompt + output), and where a step's time goes with worker
processes: the executor's round trip (encode and broadcast the plan, the workers' decode, the reply; the step's
wall time minus the output rank's own time in it) and the time the output rank spent inside collectives and stage
transfers (all-reduces and the logits' all-gather under TP; waiting for the previous stage's hidden states under
PP, which holds that stage's compute too). Their sum over the step is the communication share. Each layout's
workers split the machine's cores (on 2 cores: 2 threads for TP=1, 1 per worker for TP=2 and PP=2), so on a CPU
a split gains nothing unless the cores are many and the model large: this measures what splitting costs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Table, make_workload, model_label, prompt_token_range, resolve_bench_model

# name -> (tensor_parallel_size, pipeline_parallel_size, distributed_executor_backend)
LAYOUTS = {"uni": (1, 1, "uni"), "1x1": (1, 1, "mp"), "2x1": (2, 1, "mp"), "1x2": (1, 2, "mp"),
           "2x2": (2, 2, "mp"), "2x1-ray": (2, 1, "ray")}


def run_layout(model_dir: str, layout: str, workload, dtype: str, budget: int,  # noqa: ANN001
               repeats: int) -> dict[str, float]:
    """Generate `workload` greedily under `layout`, `repeats` times in one engine; the figures of the median run."""
    import vx

    tp, pp, backend = LAYOUTS[layout]
    llm = vx.LLM(model_dir, dtype=dtype, device="cpu", tensor_parallel_size=tp, pipeline_parallel_size=pp,
                 distributed_executor_backend=backend, max_num_batched_tokens=budget, enforce_eager=True,
                 enable_prefix_caching=False)  # every repeat computes its prompts again
    try:
        params = [vx.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
        # Warm-up: the workload's prompts with 4 output tokens, so that first-call costs stay out of the timing.
        llm.generate(workload.prompts, [p.clone(max_tokens=4) for p in params], use_tqdm=False)
        executor = llm.llm_engine.engine_core.engine_core.executor
        runs = []
        for _ in range(repeats):
            stats = getattr(executor, "stats", None)
            before = None if stats is None else (stats.steps, stats.wall_s, stats.worker_s, stats.comm_s)
            steps0 = llm.stats().num_steps
            t0 = time.perf_counter()
            llm.generate(workload.prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            steps = llm.stats().num_steps - steps0
            run = {"wall_s": wall, "steps": steps, "step_ms": 1e3 * wall / steps,
                   "out_tok_s": workload.num_output_tokens / wall,
                   "all_tok_s": (workload.num_prompt_tokens + workload.num_output_tokens) / wall,
                   "round_trip_ms": 0.0, "comm_ms": 0.0}
            if before is not None:
                n = stats.steps - before[0]
                run["round_trip_ms"] = 1e3 * ((stats.wall_s - before[1]) - (stats.worker_s - before[2])) / n
                run["comm_ms"] = 1e3 * (stats.comm_s - before[3]) / n
            runs.append(run)
    finally:
        llm.shutdown()
    return sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny | micro | qwen2.5-0.5b-random | default | a directory")
    ap.add_argument("--layouts", default="uni,1x1,2x1,1x2",
                    help=f"comma list of {', '.join(LAYOUTS)} (TPxPP; uni: no worker process; -ray: Ray actors)")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--min-prompt-len", type=int, default=32)
    ap.add_argument("--max-prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3, help="runs of the workload per layout; the median is shown")
    args = ap.parse_args(argv)
    from vx import platform

    # As the engine and worker processes do, before torch loads here (the `uni` engine runs in this process):
    # spinning OpenMP threads stall as soon as another process wants a core.
    platform.prefer_openmp_wait_policy()
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        raise SystemExit(f"--layouts: unknown {unknown}; choose from {list(LAYOUTS)}.")
    model_dir = resolve_bench_model(args.model)
    workload = make_workload(args.num_requests, (args.min_prompt_len, args.max_prompt_len),
                             (args.output_len, args.output_len), prompt_token_range(model_dir))
    results = {layout: run_layout(model_dir, layout, workload, args.dtype, args.max_num_batched_tokens, args.repeats)
               for layout in layouts}
    base = results[layouts[0]]
    table = Table(f"TP / PP splits: {model_label(args.model, model_dir)}, {workload.describe()}, {args.dtype}, "
                  f"{os.cpu_count()} cores, median of {args.repeats}",
                  ["layout", "steps", "step ms", "output tok/s", "all tok/s", f"vs {layouts[0]}",
                   "round trip ms/step", "collectives ms/step", "comm share"])
    for layout, r in results.items():
        share = (r["round_trip_ms"] + r["comm_ms"]) / r["step_ms"]
        table.add(layout, r["steps"], r["step_ms"], r["out_tok_s"], r["all_tok_s"],
                  f"{r['all_tok_s'] / base['all_tok_s']:.2f}x", r["round_trip_ms"], r["comm_ms"], f"{100 * share:.0f}%")
    table.notes.append("round trip: the executor's broadcast of the step plan (one ZMQ PUB send; a Ray call per "
                       "actor under -ray), the workers' decode and the output rank's reply; collectives: the output rank's time in all-reduce / "
                       "all-gather / stage recv (waiting for the other ranks included). uni has neither.")
    table.print()


if __name__ == "__main__":
    main()
