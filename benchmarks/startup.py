"""Start-up: time from `vx.AsyncLLM(...)` to its first streamed token, on a fresh engine each run.

    python -m benchmarks.startup                 # the default model (SmolLM2-135M-Instruct), 3 runs
    python -m benchmarks.startup --runs 5 --model path/to/model

The first start of a model on a machine fills vx's caches (~/.cache/vx or $VX_CACHE_DIR): the GGUF file's config
directory, the C kernels built for this CPU, the batch-1 decode graph compiled (in the background, while eager steps
serve). That start is made first and reported apart (with the time until it runs at full speed: its batch-1 decode
graph loaded), so the table shows the starts that load from the caches, as a user sees them from the second start
on. Each run spawns a new engine process and prints: ready (engine booted, tokenizer loaded), first token (ready +
prefill + one decode step: the first output of `generate`), shutdown, and the engine process's resident memory (RSS,
torch included) when ready, after the 8-token answer, and settled: after a second answer once the engine has settled
(no compile child left, no CPU used for a second: the batch-1 decode graph is compiled and loaded), with that figure
above a bare `import torch` process. The first start of a model also AOT-compiles its batch-1 decode graph into the
cache (in the background, while eager steps serve), so its settled figure takes longer to come. Goal for the default
model on CPU: first token under 5 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Table, resolve_bench_model  # noqa: E402 - after the path set-up above

PROMPT = "What is the capital of France?"


async def _one_start(model: str | None, engine_args: dict) -> tuple[float, float, float, int, int, int, float]:
    """Seconds to ready, to the first token and to shut down; the engine's RSS when ready, after the answer and
    settled; seconds to settled (the batch-1 decode graph loaded: full speed)."""
    import psutil

    import vx

    t0 = time.perf_counter()
    llm = vx.AsyncLLM(model, **engine_args)
    async with llm:
        t_ready = time.perf_counter() - t0
        engine = psutil.Process(llm._client.engine.proc.pid)
        rss_ready = engine.memory_info().rss
        # ignore_eos: the default model's greedy answer to the bare prompt is its end token at once, which `stream`
        # turns into no text at all; the first output of `generate` is the first token, text or not.
        params = vx.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        t_first = 0.0
        async for _ in llm.generate(PROMPT, params):
            t_first = t_first or time.perf_counter() - t0
        rss_answer = engine.memory_info().rss
        wait_until_settled(engine)
        t_settled = time.perf_counter() - t0
        async for _ in llm.generate(PROMPT, params):  # served by the decode graph, now that it is loaded
            pass
        rss_settled = engine.memory_info().rss
        t_close = time.perf_counter()
    return t_ready, t_first, time.perf_counter() - t_close, rss_ready, rss_answer, rss_settled, t_settled


def wait_until_settled(engine: Any, quiet_s: float = 1.0, timeout_s: float = 300.0) -> None:
    """Wait until the engine has no child process (a decode graph's compile, `vx.gpu.graphs.aoti_cache`) and has
    used no CPU for `quiet_s` (the graph loaded, or compiled in-process); at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    busy = sum(engine.cpu_times()[:2])
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = sum(engine.cpu_times()[:2])
        if now - busy < 0.05 * quiet_s and not engine.children():
            return
        busy = now


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vx bench startup", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="a benchmark model name, a model directory or a .gguf file (default: vx's default model)")
    ap.add_argument("--runs", type=int, default=3, help="fresh starts to time (after the cache-filling one)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=None, help="accepted for run_all; unused here")
    args = ap.parse_args(argv)
    import anyio

    from vx.config.model_source import resolve_model

    engine_args = {k: v for k, v in (("dtype", args.dtype), ("device", args.device)) if v is not None}
    t0 = time.perf_counter()
    # The one-time GGUF config directory (or random-model build), if it has not happened yet.
    model = resolve_model(args.model) if args.model and args.model.endswith(".gguf") \
        else resolve_bench_model(args.model)
    print(f"model ready in the cache after {time.perf_counter() - t0:.1f} s (made once)")

    from benchmarks.gguf_memory import bare_torch_rss

    bare = bare_torch_rss()
    # The first start of this checkout fills the caches (a no-op where an earlier start did): apart from the table.
    ready, first, _, _, _, rss_settled, settled = anyio.run(_one_start, model, engine_args)
    print(f"cache-filling start: ready {ready:.2f} s, first token {first:.2f} s, full speed (settled: the batch-1 "
          f"decode graph loaded) after {settled:.1f} s, settled engine RSS {rss_settled / 2**20:.0f} MiB (C kernels "
          "built and decode graph compiled here unless cached already)")
    table = Table("Fresh AsyncLLM start-up (cache filled)",
                  ["run", "ready (s)", "first token (s)", "shutdown (s)", "engine RSS ready (MiB)",
                   "after answer (MiB)", "settled (MiB)", "settled above bare torch (MiB)"])
    firsts, above = [], []
    for i in range(args.runs):
        ready, first, close, rss_ready, rss_answer, rss_settled, _ = anyio.run(_one_start, model, engine_args)
        firsts.append(first)
        above.append((rss_settled - bare) / 2**20)
        table.add(i + 1, f"{ready:.2f}", f"{first:.2f}", f"{close:.2f}", f"{rss_ready / 2**20:.0f}",
                  f"{rss_answer / 2**20:.0f}", f"{rss_settled / 2**20:.0f}", f"{above[-1]:.0f}")
    table.notes.append("engine RSS: the engine process's resident memory (torch, the model, the KV pages written so "
                       "far), when ready, after the 8-token answer, and settled: after a second answer, once the "
                       "engine has no compile child and has used no CPU for a second (its batch-1 decode graph "
                       "compiled and loaded, unless VX_DECODE_COMPILE=off or enforce_eager)")
    table.notes.append(f"a bare `import torch` process holds {bare / 2**20:.0f} MiB; the engine's settled RSS above "
                       f"it: {statistics.median(above):.0f} MiB (median)")
    print(table.render())
    med = statistics.median(firsts)
    print(f"median time to first streamed token of a fresh AsyncLLM: {med:.2f} s (goal < 5 s: "
          f"{'met' if med < 5 else 'not met'})")


if __name__ == "__main__":
    main()
