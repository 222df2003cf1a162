"""Offline throughput: vx beside Hugging Face `generate` on the same model and mixed workload, in one run.

    python -m benchmarks.throughput                                   # default model, the issue's workload
    python -m benchmarks.throughput --model qwen2.5-0.5b-random
    python -m benchmarks.throughput --model micro --num-requests 8 --max-prompt-len 64 --max-output-len 16

The workload (seeded): `--num-requests` requests (128), prompt lengths uniform in [16, 512] random token
ids, each generating exactly its own output length, uniform in [16, 256] (greedy, EOS ignored).

vx gets every request at once (`vx.LLM.generate`, continuous batching). Hugging Face `generate` gets them in
arrival order in batches of `--hf-batch-size` (left padding); a batch runs until its longest request is done
(min_new_tokens = max_new_tokens = the batch's largest output length), and only each request's own output
length counts as useful tokens: the rest is the price of static batching. Without `--hf-batch-size`, each of
`--hf-batch-sizes` is tried on the first requests (outputs capped at `--hf-probe-tokens`) and the fastest
is used. Both run in one dtype: `--dtype` (default `auto`, what vx's `dtype="auto"` picks here: bfloat16 on a
CPU with AMX or AVX512-BF16, else float32). Prints useful tokens/s of each, the ratio vx / HF, and vx's fraction
of the decode roofline.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (Table, Workload, add_model_args, load_hf_causal_lm, make_workload, model_label,
                               parse_int_list, prompt_token_range, quiet_logs, ratio, resolve_bench_model,
                               resolve_bench_dtype, resolve_device, set_threads)


@dataclass
class RunResult:
    """One engine's run over the workload."""

    useful_tokens: int  # tokens the requests asked for
    generated_tokens: int  # tokens computed, padding waste included
    seconds: float
    detail: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.seconds


def run_vx(model_dir: str, wl: Workload, dtype: str, device: str, **engine_args: Any) -> tuple[RunResult, Any]:
    """Generate the workload with vx in one `LLM.generate` call; returns the result and the engine config."""
    import vx

    llm = vx.LLM(model_dir, dtype=dtype, device=device, **engine_args)
    try:
        config = llm.llm_engine.config
        warm = vx.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate(wl.prompts[:2], warm, use_tqdm=False)
        params = [vx.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
        before = llm.stats()
        t0 = time.perf_counter()
        outs = llm.generate(wl.prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        stats = llm.stats()
    finally:
        llm.shutdown()
    got = [len(o.outputs[0].token_ids) for o in outs]
    if got != wl.output_lens:
        bad = sum(g != w for g, w in zip(got, wl.output_lens))
        print(f"WARNING: vx returned a wrong number of tokens for {bad} request(s)", file=sys.stderr)
    steps = stats.num_steps - before.num_steps
    detail = (f"{steps} steps, {stats.num_preemptions - before.num_preemptions} preemptions, "
              f"max_num_seqs={config.scheduler_config.max_num_seqs}, "
              f"max_num_batched_tokens={config.scheduler_config.max_num_batched_tokens}")
    return RunResult(sum(got), sum(got), dt, detail), config


class HFRunner:
    """Batched, left-padded Hugging Face `generate` over a workload."""

    def __init__(self, model_dir: str, dtype: str, device: str) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.model = load_hf_causal_lm(model_dir, dtype).to(device).eval()
        gc_ = self.model.generation_config
        gc_.eos_token_id = None  # like ignore_eos: every request runs to its length
        gc_.pad_token_id = 0
        gc_.do_sample = False
        gc_.temperature = gc_.top_p = gc_.top_k = None

    def generate_batch(self, prompts: list[list[int]], new_tokens: int) -> None:
        """One left-padded batch, exactly `new_tokens` new tokens for every row."""
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device),
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        assert out.shape[1] == width + new_tokens
        if self.device == "cuda":
            torch.cuda.synchronize()

    def run(self, wl: Workload, batch_size: int, sort_by_output: bool = False) -> RunResult:
        """The workload in batches of `batch_size` (arrival order, or sorted by output length)."""
        order = list(range(len(wl)))
        if sort_by_output:
            order.sort(key=lambda i: wl.output_lens[i])
        generated = 0
        t0 = time.perf_counter()
        for s in range(0, len(order), batch_size):
            idx = order[s:s + batch_size]
            n = max(wl.output_lens[i] for i in idx)
            self.generate_batch([wl.prompts[i] for i in idx], n)
            generated += n * len(idx)
        dt = time.perf_counter() - t0
        waste = 1 - wl.num_output_tokens / generated
        return RunResult(wl.num_output_tokens, generated, dt,
                         f"batch size {batch_size}, {100 * waste:.0f}% of generated tokens past a request's end")

    def pick_batch_size(self, wl: Workload, candidates: list[int], probe_tokens: int) -> tuple[int, dict[int, float]]:
        """The fastest batch size on the first max(candidates) requests with outputs capped at probe_tokens."""
        probe = Workload(wl.prompts[:max(candidates)], [min(n, probe_tokens) for n in wl.output_lens[:max(candidates)]])
        self.generate_batch(probe.prompts[:2], 2)  # warm-up
        rates = {bs: self.run(probe, bs).tokens_per_s for bs in candidates}
        return max(rates, key=rates.get), rates


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vx bench throughput", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, default_dtype="auto")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--min-prompt-len", type=int, default=16)
    ap.add_argument("--max-prompt-len", type=int, default=512)
    ap.add_argument("--min-output-len", type=int, default=16)
    ap.add_argument("--max-output-len", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="vx engine argument (default: vx's)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="vx engine argument")
    ap.add_argument("--hf-batch-size", type=int, default=None, help="skip the search; use this batch size")
    ap.add_argument("--hf-batch-sizes", type=parse_int_list, default=[8, 16, 32],
                    help="batch sizes to try for HF (default 8,16,32)")
    ap.add_argument("--hf-probe-tokens", type=int, default=32, help="output cap of the batch-size search")
    ap.add_argument("--hf-sort", action="store_true",
                    help="give HF the requests sorted by output length (its best case; vx gets arrival order)")
    ap.add_argument("--no-hf", action="store_true", help="run vx only")
    ap.add_argument("--no-roofline", action="store_true", help="skip the roofline measurement")
    ap.add_argument("--eager-too", action="store_true",
                    help="also run vx with enforce_eager=True (no decode graphs: CUDA graphs, or the CPU's compiled decode)")
    args = ap.parse_args(argv)
    quiet_logs()
    set_threads(args.threads)
    device = resolve_device(args.device)
    args.dtype = resolve_bench_dtype(args.dtype, device)
    model_dir = resolve_bench_model(args.model)
    wl = make_workload(args.num_requests, (args.min_prompt_len, args.max_prompt_len),
                       (args.min_output_len, args.max_output_len), prompt_token_range(model_dir), args.seed)
    label = model_label(args.model, model_dir)
    print(f"throughput: {label}, {args.dtype}, {device}; workload: {wl.describe()}\n", flush=True)

    engine_args: dict[str, Any] = {"max_model_len": args.max_prompt_len + args.max_output_len + 16}
    if args.max_num_seqs:
        engine_args["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    vx_res, config = run_vx(model_dir, wl, args.dtype, device, **engine_args)
    gc.collect()
    eager_res: RunResult | None = None
    if args.eager_too:
        eager_res, _ = run_vx(model_dir, wl, args.dtype, device, enforce_eager=True, **engine_args)
        gc.collect()

    hf_res: RunResult | None = None
    probe_note = ""
    if not args.no_hf:
        hf = HFRunner(model_dir, args.dtype, device)
        bs = args.hf_batch_size
        if bs is None:
            bs, rates = hf.pick_batch_size(wl, args.hf_batch_sizes, args.hf_probe_tokens)
            probe_note = ("HF batch-size search (useful tok/s on the first requests): "
                          + ", ".join(f"{b}: {r:.1f}" for b, r in rates.items()) + f" -> {bs}")
        else:
            hf.generate_batch(wl.prompts[:2], 2)  # warm-up
        hf_res = hf.run(wl, bs, args.hf_sort)
        del hf
        gc.collect()

    table = Table(f"Offline throughput: {label}, {args.dtype}, {device}",
                  ["engine", "useful tokens", "computed tokens", "seconds", "useful tok/s", "vs HF"])
    table.add("vx", vx_res.useful_tokens, vx_res.generated_tokens, vx_res.seconds, vx_res.tokens_per_s,
              ratio(vx_res.tokens_per_s, hf_res.tokens_per_s) if hf_res else "n/a")
    if eager_res:
        table.add("vx, enforce_eager", eager_res.useful_tokens, eager_res.generated_tokens, eager_res.seconds,
                  eager_res.tokens_per_s, ratio(eager_res.tokens_per_s, hf_res.tokens_per_s) if hf_res else "n/a")
    if hf_res:
        table.add("HF generate", hf_res.useful_tokens, hf_res.generated_tokens, hf_res.seconds,
                  hf_res.tokens_per_s, "1.00x")
    table.notes.append(f"workload: {wl.describe()}, seed {args.seed}")
    table.notes.append(f"vx: {vx_res.detail}")
    if hf_res:
        table.notes.append(f"HF: {hf_res.detail}{' (sorted by output length)' if args.hf_sort else ''}")
    if probe_note:
        table.notes.append(probe_note)
    if not args.no_roofline:
        from benchmarks.roofline import roofline_tokens_per_s

        batch = min(len(wl), config.scheduler_config.max_num_seqs)
        context = (wl.num_prompt_tokens + wl.num_output_tokens // 2) // len(wl)
        limit = roofline_tokens_per_s(model_dir, batch, args.dtype, device, context_len=context)
        table.notes.append(f"vx reaches {100 * vx_res.tokens_per_s / limit:.1f}% of the decode roofline "
                           f"({limit:,.0f} tok/s at batch {batch}, mean context {context}; prefill counts "
                           "against vx, so this understates it)")
    if vx_res.seconds < 1.0:
        table.notes.append("note: the vx run took under a second; use a larger workload for stable numbers")
    table.print()


if __name__ == "__main__":
    main()
