"""Greedy decoding of vx against Hugging Face on the same weights: exact in float32, top-1 agreement in 16 bits.

    python -m benchmarks.greedy_check --model qwen2.5-0.5b-random --device cuda --dtype float32
    python -m benchmarks.greedy_check --model qwen2.5-0.5b-random --device cuda --dtype bfloat16
    python -m benchmarks.greedy_check --model micro --device cpu          # the smoke run of gpu_check.sh --dry-run

vx generates `--max-tokens` greedy tokens for `--num-prompts` seeded random prompts (CUDA graphs on, as served).
Hugging Face then reads each prompt followed by vx's tokens in one forward, and at every generated position its
argmax is compared with vx's token (teacher forcing: one early difference does not count against every later
token). float32 must agree everywhere (the script exits 1 otherwise); in bf16/fp16 the kernels round differently,
so the agreement rate is printed, with `--min-agreement` as the bar.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (add_model_args, load_hf_causal_lm, make_workload, model_label, prompt_token_range,
                               quiet_logs, resolve_bench_model, resolve_device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.greedy_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, default_model="qwen2.5-0.5b-random")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--min-agreement", type=float, default=0.95, help="the bar for 16-bit dtypes")
    args = ap.parse_args(argv)
    quiet_logs()
    import torch

    import vx

    device = resolve_device(args.device)
    model_dir = resolve_bench_model(args.model)
    wl = make_workload(args.num_prompts, (8, 96), (args.max_tokens, args.max_tokens), prompt_token_range(model_dir),
                       args.seed)
    label = model_label(args.model, model_dir)
    print(f"greedy check: {label}, {args.dtype}, {device}, {args.num_prompts} prompts x {args.max_tokens} tokens",
          flush=True)

    t0 = time.perf_counter()
    llm = vx.LLM(model_dir, dtype=args.dtype, device=device, max_model_len=96 + args.max_tokens + 16)
    try:
        params = vx.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        outs = llm.generate(wl.prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    vx_tokens = [list(o.outputs[0].token_ids) for o in outs]
    print(f"vx: {time.perf_counter() - t0:.1f} s (start-up included)", flush=True)

    hf = load_hf_causal_lm(model_dir, args.dtype).to(device).eval()
    agree = total = 0
    first_difference: list[str] = []
    for i, (prompt, tokens) in enumerate(zip(wl.prompts, vx_tokens)):
        ids = torch.tensor([prompt + tokens], device=device)
        with torch.inference_mode():
            logits = hf(ids).logits[0, len(prompt) - 1:-1]
        hf_top = logits.argmax(-1).tolist()
        same = [a == b for a, b in zip(hf_top, tokens)]
        agree += sum(same)
        total += len(tokens)
        if not all(same) and len(first_difference) < 3:
            first_difference.append(f"prompt {i}: first difference at token {same.index(False)}")
    rate = agree / total
    exact = args.dtype == "float32"
    ok = agree == total if exact else rate >= args.min_agreement
    bar = "all" if exact else f">= {args.min_agreement:.2f}"
    print(f"top-1 agreement with Hugging Face: {agree}/{total} = {rate:.4f} (bar: {bar}) -> {'OK' if ok else 'FAIL'}")
    for line in first_difference:
        print("  " + line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
