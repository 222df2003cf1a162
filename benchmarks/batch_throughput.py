"""Equal-length batches: N requests of 128 new tokens each after a 32-token prompt, vx beside Hugging Face
`generate`'s best padded batch and llama.cpp with N parallel slots, on the same model, in one run.

    python -m benchmarks.batch_throughput                       # default model's GGUF, 32 and 128 requests, 3 rounds
    python -m benchmarks.batch_throughput --num-requests 32 --rounds 1
    python -m benchmarks.batch_throughput --gguf path/to/model.gguf --engines vx,llama.cpp

Every request has a prompt of exactly `--prompt-tokens` (32) random token ids and generates exactly `--new-tokens`
(128) greedy tokens, EOS ignored: equal lengths, so static batching wastes nothing on padding and this is padded
`generate`'s best case. Engines (`--engines`, all by default):
- `vx`: `vx.LLM` with its defaults (the engine in the process, `dtype="auto"`, the GGUF tensors kept quantized,
  vx's default `max_num_seqs`), all N requests in one `generate` call;
- `hf`: Hugging Face `generate` on the same weights (transformers dequantizes a GGUF file) in the machine's default
  dtype (bfloat16 where the CPU has AMX or AVX512-BF16, else float32), left-padded batches of the size that measured
  fastest in a short probe before the rounds (`--hf-batch-sizes`, each capped at N; `--hf-batch-size` to skip it);
- `llama.cpp`: the same GGUF file through llama-cpp-python's low-level API with N parallel slots in one context,
  every step decoding one token of each live sequence in one batch, as llama.cpp's server does
  (`benchmarks.llama_slots`); skipped, with the reason, when llama-cpp-python is missing or the model is no GGUF.

Each (engine, N) runs in a fresh child process per round, all of them taking turns round by round, with the same
threads (`--threads`, default torch's: the physical cores). A child loads the model, warms up on N other prompts
with 4 new tokens (so each engine has met the batch's shapes), then times the N requests from the call to the last
token: tokens/s = N x new tokens / that time (prefill included, model load excluded). It checks that every request
got exactly its tokens, and reports its process's resident memory after the run and at its peak; for vx that
process holds the engine and the model (`vx.LLM` runs the engine in the process), and its figure above a bare
`import torch` process is the engine's memory. The table gives medians and min-max spreads over the rounds and
vx's ratio to each engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (MODEL_CHOICES, Table, Workload, engine_model_runner, interleaved_rounds,
                               machine_description, make_workload, median_spread, model_label, parse_int_list,
                               prompt_token_range, quiet_logs, ratio, resolve_gguf_or_dir, rss_bytes, run_child,
                               select_engines, set_threads)

ENGINES = ("vx", "hf", "llama.cpp")
WARMUP_TOKENS = 4
MIB = 2**20


# --------------------------------------------------------------------------------------------- the child
def workloads(spec: dict[str, Any]) -> tuple[Workload, Workload]:
    """The warm-up and the measured requests of a child: N prompts each, different token ids (so that no prefix
    cache serves the measured prompts), the same for every engine in a round."""
    n, p = spec["num_requests"], spec["prompt_tokens"]
    both = make_workload(2 * n, (p, p), (spec["new_tokens"],) * 2, tuple(spec["token_range"]), seed=spec["seed"])
    return both.subset(n), Workload(both.prompts[n:], both.output_lens[n:])


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM); 0 where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def timed_run(generate: Callable[[list[list[int]], int], list[int]], spec: dict[str, Any]) -> dict[str, Any]:
    """Warm up, then time `generate(prompts, new_tokens)` (which returns each request's number of new tokens)."""
    warm, wl = workloads(spec)
    generate(warm.prompts, WARMUP_TOKENS)
    t0 = time.perf_counter()
    got = generate(wl.prompts, spec["new_tokens"])
    seconds = time.perf_counter() - t0
    if got != wl.output_lens:
        bad = sum(g != w for g, w in zip(got, wl.output_lens))
        raise RuntimeError(f"{bad} of {len(wl)} requests did not get {spec['new_tokens']} tokens")
    return {"seconds": seconds, "tok_s": wl.num_output_tokens / seconds, "rss_bytes": rss_bytes(),
            "peak_rss_bytes": peak_rss_bytes()}


def run_vx(spec: dict[str, Any]) -> dict[str, Any]:
    """vx.LLM with its defaults (only the threads pinned, as for every engine); one `generate` call."""
    from vx.platform import prefer_openmp_wait_policy

    prefer_openmp_wait_policy()  # what a vx application's process gets: set before torch loads
    set_threads(spec["threads"])
    import vx

    llm = vx.LLM(spec["model"], **({"dtype": spec["dtype"]} if spec["dtype"] else {}))
    cached = 0
    # Its decode graph for this batch compiles before timing (a served engine compiles it in the background the
    # first time such a batch runs): the run measures the steady state.
    graphs = engine_model_runner(llm.llm_engine).decode_graphs
    compile_s = None
    if graphs is not None:
        from vx.gpu.graphs.buffers import bucket_for

        graphs.wait()
        size = bucket_for(graphs.sizes, min(spec["num_requests"], graphs.sizes[-1]))
        graphs.compile_now([size])
        compile_s = graphs.compile_seconds.get(size)

    def generate(prompts: list[list[int]], n: int) -> list[int]:
        nonlocal cached
        params = vx.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        cached = max(cached, max(o.num_cached_tokens for o in outs))
        return [len(o.outputs[0].token_ids) for o in outs]

    try:
        before = llm.stats()
        result = timed_run(generate, spec)
        stats = llm.stats()
        config = llm.llm_engine.config
        result.update(dtype=config.model_config.dtype, quantization=config.quant_config.method,
                      max_num_seqs=config.scheduler_config.max_num_seqs,
                      max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
                      steps=stats.num_steps - before.num_steps,
                      preemptions=stats.num_preemptions - before.num_preemptions, cached_tokens=cached,
                      decode_compile_s=compile_s)
    finally:
        llm.shutdown()
    return result


def run_hf(spec: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face `generate` in left-padded batches of `spec['batch_size']` (or, with `spec['probe']`, the
    useful tokens/s of each candidate batch size on the first requests with short outputs)."""
    set_threads(spec["threads"])
    from benchmarks.throughput import HFRunner

    quiet_logs()
    hf = HFRunner(spec["model_dir"], spec["dtype"], "cpu")
    if spec.get("probe"):
        _, wl = workloads(spec)
        wl = Workload(wl.prompts, [spec["probe_tokens"]] * len(wl))
        _, rates = hf.pick_batch_size(wl, spec["batch_sizes"], spec["probe_tokens"])
        return {"rates": {str(bs): rate for bs, rate in rates.items()}}
    bs = spec["batch_size"]

    def generate(prompts: list[list[int]], n: int) -> list[int]:
        for s in range(0, len(prompts), bs):
            hf.generate_batch(prompts[s:s + bs], n)  # asserts that every row got n new tokens
        return [n] * len(prompts)

    return timed_run(generate, spec)


def run_llama_cpp(spec: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp with one parallel slot per request (benchmarks.llama_slots)."""
    from benchmarks.llama_slots import ParallelSlots

    seq_len = spec["prompt_tokens"] + spec["new_tokens"] + 1
    with ParallelSlots(spec["model"], spec["num_requests"], seq_len, spec["threads"],
                       kv_unified=spec["kv_unified"]) as slots:

        def generate(prompts: list[list[int]], n: int) -> list[int]:
            return [len(o) for o in slots.generate(prompts, n)]

        result = timed_run(generate, spec)
        result["context"] = slots.describe()
    return result


def _child(spec: dict[str, Any]) -> None:
    runner = {"vx": run_vx, "hf": run_hf, "llama.cpp": run_llama_cpp}[spec["engine"]]
    print("RESULT " + json.dumps(runner(spec)), flush=True)


# -------------------------------------------------------------------------------------------- the parent
def _engines(ns: argparse.Namespace, gguf: str | None) -> tuple[list[str], list[str]]:
    """The engines to run and the notes on those skipped."""
    names, skipped = select_engines(ns.engines, ENGINES, gguf)
    return names, skipped


def kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """Bytes of one token's keys and values over all layers, in a KV cache of the model's `dtype` (vx's default
    `kv_cache_dtype="auto"`)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return cfg.num_hidden_layers * 2 * kv_heads * head_dim * {"float32": 4}.get(dtype, 2)


def _load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vx bench batch_throughput", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="a GGUF file (default: the default model's Q4_1 file)")
    ap.add_argument("--model", default="default",
                    help=f"instead of --gguf: one of {', '.join(MODEL_CHOICES)}, a .gguf file or a Hugging Face "
                         "model directory (llama.cpp runs only GGUF files)")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    ap.add_argument("--num-requests", type=parse_int_list, default=[32, 128],
                    help="comma-separated batch sizes N: N requests at once (default 32,128)")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="every prompt's length (default 32)")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens every request generates (default 128)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of every engine (default 3)")
    ap.add_argument("--dtype", default=None, help="vx's dtype (default: vx's own choice for the machine)")
    ap.add_argument("--hf-dtype", default=None,
                    help="Hugging Face's dtype (default: bfloat16 where the CPU has AMX or AVX512-BF16, else float32)")
    ap.add_argument("--hf-batch-sizes", type=parse_int_list, default=[8, 16, 32, 64, 128],
                    help="batch sizes the probe tries, each capped at N (default 8,16,32,64,128)")
    ap.add_argument("--hf-batch-size", type=int, default=None, help="skip the probe; use this batch size (capped at N)")
    ap.add_argument("--hf-probe-tokens", type=int, default=16, help="new tokens per request in the probe (default 16)")
    ap.add_argument("--llama-kv-unified", action="store_true",
                    help="llama.cpp: one KV buffer shared by the slots (default: a stretch per slot, as the server "
                         "gives `-np N`)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads of every engine (default: torch's default, the physical cores)")
    ap.add_argument("--device", default="cpu", choices=["auto", "cpu"],
                    help="accepted for run_all; every engine here runs on the CPU")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (round r uses seed + r)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        _child(json.loads(ns.child))
        return
    if ns.rounds < 1 or ns.prompt_tokens < 1 or ns.new_tokens < 1:
        ap.error("need rounds, prompt tokens and new tokens >= 1")
    quiet_logs()
    load_before = _load_average()
    gguf, model_dir = resolve_gguf_or_dir(ns.gguf or ns.model)
    engines, skipped = _engines(ns, gguf)
    for note in skipped:
        print(note, flush=True)
    import torch

    from benchmarks.gguf_memory import bare_torch_rss
    from benchmarks.latency import gguf_weight_types
    from vx.platform import cpu_has_native_bf16

    threads = ns.threads or torch.get_num_threads()
    hf_dtype = ns.hf_dtype or ("bfloat16" if cpu_has_native_bf16() else "float32")
    sizes = ns.num_requests
    base_spec = dict(model_dir=model_dir, threads=threads, prompt_tokens=ns.prompt_tokens, new_tokens=ns.new_tokens,
                     token_range=prompt_token_range(model_dir), kv_unified=ns.llama_kv_unified)
    model = gguf or model_dir

    # HF's batch size for each N: the fastest candidate (capped at N) of one probe on the largest N's prompts.
    hf_batch: dict[int, int] = {}
    probe_note = ""
    if "hf" in engines:
        if ns.hf_batch_size:
            hf_batch = {n: min(ns.hf_batch_size, n) for n in sizes}
        else:
            candidates = sorted({min(bs, max(sizes)) for bs in ns.hf_batch_sizes})
            print(f"HF batch-size probe: {candidates} ...", file=sys.stderr, flush=True)
            got = run_child("benchmarks.batch_throughput", ["--child", json.dumps(dict(
                base_spec, engine="hf", model=model_dir, dtype=hf_dtype, num_requests=max(sizes), seed=ns.seed,
                probe=True, batch_sizes=candidates, probe_tokens=ns.hf_probe_tokens))], threads)
            if isinstance(got, str):
                raise SystemExit(f"the HF batch-size probe {got}")
            rates = {int(bs): rate for bs, rate in got["rates"].items()}
            for n in sizes:
                fitting = {bs: r for bs, r in rates.items() if bs <= n}
                hf_batch[n] = max(fitting, key=fitting.get)
            probe_note = (f"HF batch size: the fastest in a probe on {max(sizes)} requests x {ns.hf_probe_tokens} "
                          "new tokens (useful tok/s: " + ", ".join(f"{bs}: {r:.1f}" for bs, r in rates.items())
                          + "), at most N: " + ", ".join(f"{bs} for N={n}" for n, bs in hf_batch.items()) + ".")

    runs = [f"{engine} x{n}" for n in sizes for engine in engines]

    def run_one(name: str, r: int) -> dict | str:
        engine, n = name.split(" x")
        spec = dict(base_spec, engine=engine, num_requests=int(n), seed=ns.seed + r,
                    model=model if engine != "hf" else model_dir,
                    dtype=hf_dtype if engine == "hf" else ns.dtype, batch_size=hf_batch.get(int(n)))
        return run_child("benchmarks.batch_throughput", ["--child", json.dumps(spec)], threads)

    bare = bare_torch_rss()
    results, failures = interleaved_rounds(runs, ns.rounds, run_one)

    weights = f"{gguf_weight_types(gguf)} GGUF" if gguf else "checkpoint"
    label = os.path.basename(gguf) if gguf else model_label(ns.model, model_dir)
    table = Table(f"Equal-length batches: {label}, {ns.prompt_tokens}-token prompts, {ns.new_tokens} new tokens each, "
                  f"{threads} threads",
                  ["N", "engine", "dtype / weights", "tok/s", "seconds", "RSS MiB", "peak MiB", "vx vs it"])
    vx_notes = []
    for n in sizes:
        vx_runs = results.get(f"vx x{n}") or []
        vx_tok_s = statistics.median(r["tok_s"] for r in vx_runs) if vx_runs else float("nan")
        for engine in engines:
            name = f"{engine} x{n}"
            runs_ = results[name]
            if not runs_:
                table.add(n, engine, failures.get(name, "no result"))
                continue
            if engine == "vx":
                quant = runs_[0]["quantization"]
                what = f"{runs_[0]['dtype']} / {weights + ' kept quantized' if gguf else quant or 'float weights'}"
                above = statistics.median(r["rss_bytes"] - bare for r in runs_) / MIB
                # The block pool hands out never-used blocks before freed ones (its free queue is LRU, for the
                # prefix cache), so every token the warm-up and the run wrote still has its own resident page.
                written = n * (2 * ns.prompt_tokens + WARMUP_TOKENS + ns.new_tokens)
                kv = written * kv_bytes_per_token(model_dir, runs_[0]["dtype"]) / MIB
                vx_notes.append(f"vx, N={n}: max_num_seqs {runs_[0]['max_num_seqs']}, max_num_batched_tokens "
                                f"{runs_[0]['max_num_batched_tokens']}, {runs_[0]['steps']} steps, "
                                f"{runs_[0]['preemptions']} preemptions; its process holds {above:.0f} MiB above a "
                                f"bare torch process, of which ~{kv:.0f} MiB are the KV cache blocks that the warm-up "
                                f"and the run wrote ({written:,} tokens; the block pool hands out unused blocks "
                                "before freed ones, so all stay resident).")
                compiled = [r["decode_compile_s"] for r in runs_ if r.get("decode_compile_s") is not None]
                if compiled:
                    vx_notes.append(f"vx, N={n}: its decode graph for the batch compiled before timing in "
                                    f"{median_spread(compiled)[0]:.1f} s (median).")
                if any(r["cached_tokens"] for r in runs_):
                    vx_notes.append(f"WARNING: vx's prefix cache served part of a measured prompt at N={n}.")
            elif engine == "hf":
                what = f"{hf_dtype}{' / dequantized' if gguf else ''}, batches of {hf_batch[n]}"
            else:
                what = f"{weights}, {n} slots"
            tok_s, tok_s_spread = median_spread([r["tok_s"] for r in runs_])
            seconds, _ = median_spread([r["seconds"] for r in runs_])
            rss, _ = median_spread([r["rss_bytes"] for r in runs_], 1 / MIB)
            peak, _ = median_spread([r["peak_rss_bytes"] for r in runs_], 1 / MIB)
            table.add(n, engine, what, f"{tok_s:.1f} ({tok_s_spread})", seconds, f"{rss:.0f}", f"{peak:.0f}",
                      ratio(vx_tok_s, tok_s))
    table.notes.append(f"Medians of {ns.rounds} interleaved rounds (spread min-max), each engine in a fresh process. "
                       f"Machine: {machine_description()}; threads: {threads} for every engine; load average "
                       f"{load_before} before, {_load_average()} after.")
    table.notes.append(f"tok/s: N x {ns.new_tokens} new tokens (greedy, EOS ignored) / the seconds from the call to "
                       "the last token, prefill included, load and warm-up excluded. vx vs it: vx's tok/s / its.")
    table.notes.append(f"RSS: the whole process after the run, and its peak; a bare `import torch` process holds "
                       f"{bare / MIB:.0f} MiB.")
    table.notes += vx_notes
    if probe_note:
        table.notes.append(probe_note)
    llama_runs = [r for n in sizes for r in results.get(f"llama.cpp x{n}", [])[:1]]
    if llama_runs:
        table.notes.append("llama.cpp: " + "; ".join(r["context"] for r in llama_runs)
                           + ("; KV unified" if ns.llama_kv_unified else "; a KV stretch per slot")
                           + ", greedy by argmax over the sampled rows.")
    table.notes += skipped
    for name, why in failures.items():
        table.notes.append(f"{name}: {why}")
    table.print()


if __name__ == "__main__":
    main()
