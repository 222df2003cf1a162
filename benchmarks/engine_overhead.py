"""Engine overhead: the CPU time vx spends per running request per step outside the model.

    python -m benchmarks.engine_overhead                       # 256 and 1024 running requests
    python -m benchmarks.engine_overhead --num-running 64,4096 --steps 128

Drives `vx.core.scheduler.Scheduler` and `vx.cache.KVCacheManager` directly with a no-op model: a fake
runner returns one token for every request that samples. `--num-running` requests (prompts of
`--min-prompt-len`..`--max-prompt-len` random tokens, prefix caching on unless `--no-prefix-caching`) are
admitted and prefilled first; then `--steps` pure decode steps are timed, phase by phase:

- schedule: `Scheduler.schedule()` (token budget, KV slot allocation, block hashing);
- update_from_output: `Scheduler.update_from_output()` (append tokens, stop checks, engine outputs);
- update_states + prepare: `InputBatch` turning the plan into step tensors (the model runner's CPU side);
- encode: msgpack of the step's `EngineCoreOutputs`, as the engine process sends it.

Reported in microseconds per running request per step, beside the target of 30 µs for the scheduler + KV
cache manager (schedule + update_from_output) at 1,024 running requests.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Table, parse_int_list, ratio

TARGET_US = 30.0
PHASES = ("schedule", "update_from_output", "update_states", "prepare", "encode")


def build_engine_parts(num_running: int, prompt_len: tuple[int, int], steps: int, block_size: int,
                       prefix_caching: bool, seed: int = 0) -> tuple[Any, Any]:
    """A Scheduler over a KVCacheManager sized to hold every request for the whole run, with the
    requests queued; returns (scheduler, input_batch)."""
    import torch

    from vx.cache import KVCacheManager
    from vx.config import CacheConfig, SchedulerConfig
    from vx.core.request import Request
    from vx.core.scheduler import Scheduler
    from vx.gpu.input_batch import InputBatch
    from vx.sampling_params import SamplingParams

    max_len = prompt_len[1] + steps + 8
    blocks_per_req = -(-max_len // block_size) + 1
    num_blocks = num_running * blocks_per_req + 2
    cache = CacheConfig(block_size=block_size, num_kv_blocks=num_blocks, enable_prefix_caching=prefix_caching)
    # A budget that admits and prefills every request in the first step; decode steps need num_running.
    sched_cfg = SchedulerConfig(max_num_seqs=num_running, max_num_batched_tokens=num_running * prompt_len[1],
                                enable_chunked_prefill=True)
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    scheduler = Scheduler(sched_cfg, cache, kv, max_model_len=max_len)
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)  # none ends early
    for i in range(num_running):
        prompt = [rng.randrange(100, 30000) for _ in range(rng.randint(*prompt_len))]
        scheduler.add_request(Request(f"req-{i}", prompt, params, eos_token_ids=[0]))
    return scheduler, InputBatch(block_size, torch.device("cpu"))


def fake_runner(sampling_req_ids: list[str]) -> Any:
    """The no-op model: token 7 for every request that reached the end of its known tokens."""
    from vx.step import ModelRunnerOutput

    return ModelRunnerOutput(list(sampling_req_ids), [7] * len(sampling_req_ids))


def one_step(scheduler: Any, batch: Any, acc: dict[str, float] | None) -> int:
    """Run one engine step around the fake runner, adding each phase's seconds to `acc`; returns the
    number of requests scheduled."""
    from vx.core.protocol import encode_output

    pc = time.perf_counter
    t0 = pc()
    so = scheduler.schedule()
    t1 = pc()
    batch.update_states(so)
    t2 = pc()
    sampling_req_ids = batch.prepare(so).sampling_req_ids if so.total_num_scheduled_tokens else []
    t3 = pc()
    ro = fake_runner(sampling_req_ids)
    t4 = pc()
    outs = scheduler.update_from_output(so, ro)
    t5 = pc()
    encode_output(outs)
    t6 = pc()
    if acc is not None:
        for name, dt in zip(PHASES, (t1 - t0, t5 - t4, t2 - t1, t3 - t2, t6 - t5)):
            acc[name] += dt
    return so.num_reqs


def measure_overhead(num_running: int, steps: int, prompt_len: tuple[int, int], block_size: int,
                     prefix_caching: bool, seed: int = 0) -> dict[str, float]:
    """Seconds per phase per running request per step, over `steps` decode steps of `num_running`."""
    scheduler, batch = build_engine_parts(num_running, prompt_len, steps, block_size, prefix_caching, seed)
    while scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in scheduler.running):
        one_step(scheduler, batch, None)  # admission and prefill, untimed
    for _ in range(2):
        one_step(scheduler, batch, None)  # first decode steps warm the caches
    if len(scheduler.running) != num_running:
        raise RuntimeError(f"only {len(scheduler.running)} of {num_running} requests are running")
    gc.collect()
    acc = dict.fromkeys(PHASES, 0.0)
    scheduled = 0
    for _ in range(steps):
        scheduled += one_step(scheduler, batch, acc)
    return {k: v / scheduled for k, v in acc.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vx bench engine_overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-running", type=parse_int_list, default=[256, 1024],
                    help="running-request counts to measure (default 256,1024)")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps per count (default 64)")
    ap.add_argument("--min-prompt-len", type=int, default=64)
    ap.add_argument("--max-prompt-len", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    results = {n: measure_overhead(n, args.steps, (args.min_prompt_len, args.max_prompt_len), args.block_size,
                                   not args.no_prefix_caching, args.seed) for n in args.num_running}
    cols = [f"{n} running" for n in args.num_running]
    t = Table("Engine overhead per running request per decode step (µs), no-op model", ["phase"] + cols)
    for phase in PHASES:
        t.add(phase, *[results[n][phase] * 1e6 for n in args.num_running])
    core = {n: (r["schedule"] + r["update_from_output"]) * 1e6 for n, r in results.items()}
    t.add("scheduler + KV (schedule + update)", *[core[n] for n in args.num_running])
    t.add("input building (update_states + prepare)",
          *[(r["update_states"] + r["prepare"]) * 1e6 for r in results.values()])
    t.add("all of the above", *[sum(r.values()) * 1e6 for r in results.values()])
    t.add(f"scheduler + KV vs {TARGET_US:.0f} µs target", *[ratio(core[n], TARGET_US) for n in args.num_running])
    t.add("ms per step (all phases)", *[sum(r.values()) * n * 1e3 for n, r in results.items()])
    t.notes.append(f"{args.steps} timed decode steps after prefill; prompts {args.min_prompt_len}-"
                   f"{args.max_prompt_len} tokens, block size {args.block_size}, prefix caching "
                   f"{'off' if args.no_prefix_caching else 'on'}, Python's GC on as in the engine; "
                   f"target: scheduler + KV < {TARGET_US:.0f} µs at 1,024 running (a ratio below 1.00x meets it)")
    t.print()


if __name__ == "__main__":
    main()
