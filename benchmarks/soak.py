"""Soak: minutes of random streaming load with cancellations; does either process's memory grow?

    python -m benchmarks.soak                            # 10 minutes on the micro random model
    python -m benchmarks.soak --minutes 2 --concurrency 64 --backend trio
    python -m benchmarks.soak --model default --minutes 30

`--concurrency` tasks keep an `AsyncLLM` busy until the time is up. Each one loops: a random token-id prompt,
random sampling params (greedy or random, 1..`--max-output-len` tokens), through `stream`, `generate` or
`complete`; a `--cancel-fraction` of the requests is cancelled at a random moment (leaving the loop, cancelling
the task's scope, or `anyio.fail_after`), and about 1% are bad requests that must be refused with ValueError.
The KV cache (`--num-kv-blocks`) is smaller than the load needs, so requests are preempted and resumed too.

The resident memory (RSS) of the front-end process (this one) and of the engine process is read after a
warm-up (a tenth of the run, at most 30 s) and again at the end, once the load has stopped; the report gives
both, their growth in %, the requests served, and a leak check (no KV block in use, no front-end state left).
There is no competitor here: the comparison is the process with itself, start against end.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import REPO_ROOT, Table, add_model_args, model_label

_MIB = 1024 * 1024


@dataclass
class Counters:
    """What the load did, for the report."""

    started: int = 0
    completed: int = 0
    cancelled: int = 0
    refused: int = 0  # bad requests refused with ValueError, as they must be
    outputs: int = 0  # text deltas / RequestOutputs received
    errors: list[str] = field(default_factory=list)  # anything unexpected


@dataclass
class MemorySample:
    """RSS of both processes at one moment (seconds since the load started)."""

    t: float
    front_end: int
    engine: int


def resolve_model_in_child(spec: str) -> str:
    """`benchmarks.common.resolve_bench_model(spec)` run in a child process: building a random model imports
    torch, which would otherwise inflate (and blur) the front end's memory."""
    code = "import sys; from benchmarks.common import resolve_bench_model; print(resolve_bench_model(sys.argv[1]))"
    out = subprocess.run([sys.executable, "-c", code, spec], cwd=REPO_ROOT, check=True, stdout=subprocess.PIPE,
                         text=True)
    return out.stdout.strip().splitlines()[-1]


def rss(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def front_end_state(llm: Any) -> int:
    """Per-request entries the AsyncLLM still holds (0 when nothing runs)."""
    op = llm.output_processor
    return (len(op.queues()) + len(op.deferred_drops) + len(op.request_states)
            + len(llm.output_processor.parent_requests)
            + len(llm._client._utility_waiters))


class Soak:
    """The load generator: `concurrency` client tasks against one AsyncLLM until the deadline."""

    def __init__(self, llm: Any, args: argparse.Namespace, token_range: tuple[int, int]) -> None:
        self.llm = llm
        self.args = args
        self.token_range = token_range
        self.counters = Counters()
        self.deadline = 0.0

    def random_request(self, rng: random.Random) -> tuple[list[int], Any]:
        import vx

        a = self.args
        lo, hi = self.token_range
        prompt = [rng.randrange(lo, hi) for _ in range(rng.randint(a.min_prompt_len, a.max_prompt_len))]
        greedy = rng.random() < 0.5
        params = vx.SamplingParams(
            temperature=0.0 if greedy else rng.uniform(0.5, 1.2), top_p=1.0 if greedy else rng.uniform(0.8, 1.0),
            top_k=0 if greedy else rng.choice([0, 20]), max_tokens=rng.randint(1, a.max_output_len),
            ignore_eos=rng.random() < 0.8, seed=rng.randrange(2**31) if rng.random() < 0.3 else None)
        return prompt, params

    async def one_request(self, rng: random.Random) -> None:
        import anyio

        c, llm = self.counters, self.llm
        prompt, params = self.random_request(rng)
        if rng.random() < 0.01:  # bad input: must be refused at once, without disturbing the others
            bad = rng.choice([[], [self.token_range[1] + 10**6], "", [1.5]])
            try:
                await llm.complete(bad, params)
                c.errors.append(f"bad prompt {bad!r} was accepted")
            except ValueError:
                c.refused += 1
            return
        c.started += 1
        mode = rng.choice(["stream", "generate", "complete"])
        cancel = rng.choice(["break", "scope", "fail_after"]) if rng.random() < self.args.cancel_fraction else None
        if cancel == "break" and mode == "complete":
            mode = "stream"  # there is no loop to leave in complete()
        stop_after = rng.randint(1, max(1, params.max_tokens // 2)) if cancel == "break" else None
        delay = rng.uniform(0.0, self.args.max_cancel_delay)

        async def consume() -> bool:
            if mode == "complete":
                await llm.complete(prompt, params)
                c.outputs += 1
                return True
            n = 0
            agen = llm.stream(prompt, params) if mode == "stream" else llm.generate(
                prompt, params.clone(output_kind=rng.choice(list(type(params.output_kind)))))
            async for _ in agen:
                n += 1
                c.outputs += 1
                if n == stop_after:
                    return False  # leaves the loop early: the request is aborted
            return True

        finished = False
        if cancel == "scope":
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    async def cancel_later() -> None:
                        await anyio.sleep(delay)
                        scope.cancel()
                    tg.start_soon(cancel_later)
                    finished = await consume()
                    tg.cancel_scope.cancel()
        elif cancel == "fail_after":
            try:
                with anyio.fail_after(delay):
                    finished = await consume()
            except TimeoutError:
                pass
        else:
            finished = await consume()
        if finished:
            c.completed += 1
        else:
            c.cancelled += 1

    async def worker(self, wid: int) -> None:
        rng = random.Random(self.args.seed * 100_003 + wid)
        while time.monotonic() < self.deadline:
            try:
                await self.one_request(rng)
            except Exception as e:  # noqa: BLE001 - report it, keep the load going
                self.counters.errors.append(f"{type(e).__name__}: {e}")
                if len(self.counters.errors) > 20:
                    raise

    async def run(self, seconds: float) -> None:
        import anyio

        self.deadline = time.monotonic() + seconds
        async with anyio.create_task_group() as tg:
            for wid in range(self.args.concurrency):
                tg.start_soon(self.worker, wid)


async def soak(model_dir: str, args: argparse.Namespace, engine_args: dict[str, Any]) -> dict[str, Any]:
    """Warm up, sample memory, run the load, settle, sample again; returns everything the report needs."""
    import anyio

    import vx

    total = args.minutes * 60.0
    warmup = min(30.0, total / 10)
    async with vx.AsyncLLM(model_dir, **engine_args) as llm:
        vocab = llm.config.model_config.vocab_size
        hi = min(vocab, len(llm.tokenizer))
        load = Soak(llm, args, (min(100, hi // 4), hi))
        engine_pid = llm._client.engine.proc.pid
        me = os.getpid()
        t0 = time.monotonic()
        await load.run(warmup)
        gc.collect()
        start = MemorySample(time.monotonic() - t0, rss(me), rss(engine_pid))
        started_at_mark = load.counters.started
        samples = [start]

        async def sample_memory() -> None:
            while True:
                await anyio.sleep(max(5.0, (total - warmup) / 10))
                samples.append(MemorySample(time.monotonic() - t0, rss(me), rss(engine_pid)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(sample_memory)
            await load.run(total - warmup)
            tg.cancel_scope.cancel()
        # Let every abort land, then read the end state.
        gc.collect()
        await anyio.sleep(0.5)
        stats = await llm.stats()
        state = front_end_state(llm)
        end = MemorySample(time.monotonic() - t0, rss(me), rss(engine_pid))
        samples.append(end)
    return dict(counters=load.counters, start=start, end=end, samples=samples, stats=stats, front_end_state=state,
                measured_requests=load.counters.started - started_at_mark, wall=end.t, warmup=warmup)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vx bench soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, default_model="micro")
    ap.add_argument("--minutes", type=float, default=10.0, help="how long the load runs (default 10)")
    ap.add_argument("--concurrency", type=int, default=32, help="client tasks sending requests")
    ap.add_argument("--cancel-fraction", type=float, default=0.3, help="share of requests cancelled early")
    ap.add_argument("--max-cancel-delay", type=float, default=0.3,
                    help="a scope / fail_after cancellation comes uniformly in [0, this] s after the request")
    ap.add_argument("--min-prompt-len", type=int, default=4)
    ap.add_argument("--max-prompt-len", type=int, default=96)
    ap.add_argument("--max-output-len", type=int, default=48)
    ap.add_argument("--num-kv-blocks", type=int, default=128, help="KV blocks of 16 tokens (small: preemption)")
    ap.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"], help="anyio backend")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # for the engine process; torch stays out of here

    import anyio

    model_dir = resolve_model_in_child(args.model)
    label = model_label(args.model, model_dir)
    max_len = args.max_prompt_len + args.max_output_len + 16
    engine_args = dict(dtype=args.dtype, device=args.device, max_model_len=max_len, block_size=16,
                       num_kv_blocks=max(args.num_kv_blocks, -(-max_len // 16) + 1))
    print(f"soak: {label}, {args.dtype}, device {args.device}, {args.backend}; {args.minutes:g} min, "
          f"{args.concurrency} concurrent clients, {args.cancel_fraction:.0%} cancelled, prompts "
          f"{args.min_prompt_len}-{args.max_prompt_len} tokens, outputs 1-{args.max_output_len}, "
          f"{engine_args['num_kv_blocks']} KV blocks\n", flush=True)
    r = anyio.run(soak, model_dir, args, engine_args, backend=args.backend)

    c, start, end, stats = r["counters"], r["start"], r["end"], r["stats"]
    t = Table(f"Resident memory, {args.minutes:g}-minute soak ({label}, {args.backend})",
              ["process", "RSS start MiB", "RSS end MiB", "growth %"])
    for name, a, b in (("front end (AsyncLLM)", start.front_end, end.front_end),
                       ("engine", start.engine, end.engine)):
        t.add(name, a / _MIB, b / _MIB, (b - a) / a * 100)
    t.notes.append(f"start: after {r['warmup']:.0f} s of warm-up; end: once the load stopped, at {end.t:.0f} s")
    t.print()

    trend = Table("RSS over time (MiB)", ["t s", "front end", "engine"])
    for s in r["samples"]:
        trend.add(s.t, s.front_end / _MIB, s.engine / _MIB)
    trend.print()

    leak_free = (stats.num_running, stats.num_waiting, stats.kv_blocks_in_use, r["front_end_state"]) == (0, 0, 0, 0)
    load = Table("Load", ["metric", "value"])
    for k, v in (("requests", c.started), ("  completed", c.completed), ("  cancelled early", c.cancelled),
                 ("requests after warm-up", r["measured_requests"]), ("bad requests refused", c.refused),
                 ("outputs received (text deltas, RequestOutputs)", c.outputs), ("requests/s", c.started / r["wall"]),
                 ("preemptions", stats.num_preemptions), ("engine steps", stats.num_steps),
                 ("unexpected errors", len(c.errors)),
                 ("leak check (no block, queue or front-end state left)", "ok" if leak_free else "LEAK")):
        load.add(k, v)
    load.print()
    for e in c.errors[:10]:
        print("unexpected:", e)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"minutes": args.minutes, "model": label, "backend": args.backend,
                       "rss_start": [start.front_end, start.engine], "rss_end": [end.front_end, end.engine],
                       "requests": c.started, "completed": c.completed, "cancelled": c.cancelled,
                       "refused": c.refused, "outputs": c.outputs, "preemptions": stats.num_preemptions,
                       "errors": c.errors, "leak_free": leak_free}, f, indent=1)
    if c.errors or not leak_free:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
