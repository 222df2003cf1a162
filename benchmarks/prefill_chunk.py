"""Prefill chunk: prompt tokens/s and the time of one step, per token budget (`max_num_batched_tokens`).

    python -m benchmarks.prefill_chunk                                    # budgets 128..2048, a 1024-token prompt
    python -m benchmarks.prefill_chunk --budgets 256,512,1024 --prompt-len 2048 --rounds 5

The budget is the most prompt tokens one step computes. A larger chunk runs the GEMMs at a better rate, but every
running stream waits for the whole step before its next token. For each budget, one engine (prefix caching off, so
every round computes its prompt in full) prefills a fresh random `--prompt-len`-token prompt in chunks of that
budget, per round; the engines take turns, each round starting one later, so a load that comes and goes on a shared
machine touches them alike. The table gives each budget's median prompt tokens/s and milliseconds per step over the
rounds, the spread of tokens/s (min-max), and tokens/s against the first budget.
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

from benchmarks.common import (Table, add_model_args, model_label, parse_int_list, quiet_logs, ratio,
                               resolve_bench_model, set_threads)


def start_engine(model_dir: str, budget: int, args: argparse.Namespace) -> Any:
    """An LLMEngine whose steps compute at most `budget` tokens, with room for one prompt."""
    from vx.client.llm_engine import LLMEngine
    from vx.config import EngineArgs

    max_len = args.prompt_len + 16
    return LLMEngine.from_engine_args(EngineArgs(
        model=model_dir, dtype=args.dtype, device=args.device, max_num_seqs=1, max_num_batched_tokens=budget,
        max_model_len=max_len, enable_prefix_caching=False, num_kv_blocks=-(-max_len // 16) + 1))


def prefill(engine: Any, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds and steps to compute `prompt` and sample its first token."""
    import vx

    engine.add_request(request_id, prompt, vx.SamplingParams(max_tokens=1, temperature=0.0))
    steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return time.perf_counter() - t0, steps


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vx bench prefill_chunk", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--budgets", type=parse_int_list, default=[128, 256, 512, 1024, 2048],
                    help="max_num_batched_tokens values to compare, the first is the base")
    ap.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens prefilled per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds: the budgets take turns, one prompt each")
    args = ap.parse_args(argv)
    quiet_logs()
    set_threads(args.threads)
    model_dir = resolve_bench_model(args.model)
    engines = {b: start_engine(model_dir, b, args) for b in args.budgets}
    rng = random.Random(args.seed)
    vocab = next(iter(engines.values())).config.model_config.vocab_size
    rates: dict[int, list[float]] = {b: [] for b in args.budgets}
    step_ms: dict[int, list[float]] = {b: [] for b in args.budgets}
    try:
        for b in args.budgets:  # warm-up: the first step of an engine pays one-time costs
            prefill(engines[b], "warm", [rng.randrange(1, vocab) for _ in range(min(64, args.prompt_len))])
        for r in range(args.rounds):
            order = args.budgets[r % len(args.budgets):] + args.budgets[:r % len(args.budgets)]
            for b in order:
                prompt = [rng.randrange(1, vocab) for _ in range(args.prompt_len)]
                seconds, steps = prefill(engines[b], f"r{r}", prompt)
                rates[b].append(args.prompt_len / seconds)
                step_ms[b].append(seconds / steps * 1000)
    finally:
        for engine in engines.values():
            engine.shutdown()
    base = statistics.median(rates[args.budgets[0]])
    table = Table(f"Prefill chunk: {model_label(args.model, model_dir)}, {args.dtype}, a {args.prompt_len}-token "
                  "prompt", ["max_num_batched_tokens", "prompt tok/s", "spread (tok/s)", "ms per step",
                             f"vs {args.budgets[0]}"])
    for b in args.budgets:
        med = statistics.median(rates[b])
        table.add(b, med, f"{min(rates[b]):.0f}-{max(rates[b]):.0f}", statistics.median(step_ms[b]),
                  ratio(med, base))
    table.notes.append(f"median over {args.rounds} rounds; the budgets take turns within each round, one engine "
                       "each, in this process; prefix caching off; ms per step: what a running stream would wait "
                       "for its next token while this prompt is prefilled")
    table.print()


if __name__ == "__main__":
    main()
