"""KV-cache dtype: accuracy per byte of the 8-bit caches (fp8_e4m3, int8) beside the float cache, and the time of a
decode step's attention over each, in one run.

    python -m benchmarks.kv_cache_dtype                       # the default model, 8 questions, 16 tokens each
    python -m benchmarks.kv_cache_dtype --max-tokens 32 --kv-cache-dtypes auto,fp8_e4m3,int8
    python -m benchmarks.kv_cache_dtype --attention-rounds 0  # accuracy only

The same questions (chat template, greedy, `--max-tokens`) run once per `--kv-cache-dtypes` entry, one engine
each; the first entry is the reference. Per dtype: the bytes of one token's keys and values across the model
(what decides how many tokens a memory budget holds), the rms error of a round trip through the format of the keys
and values the reference engine actually cached (relative to their rms), how many generations keep every reference
token, and the most a token's log-probability moved before the generations part.

Attention: the decode attention of every layer of the model's shape (its heads, kv heads, head_dim, layers), for
`--attention-batch` sequences of `--attention-context` tokens, each layer with its own cache (as in the engine, so the
caches stream from memory rather than from the CPU's last-level cache), through the attention backend `auto` picks
for each dtype; the dtypes take turns over `--attention-rounds` rounds (median, interquartile range). The whole
engine step: `decode_step --kv-cache-dtypes`.
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

from benchmarks.common import (Table, add_model_args, engine_model_runner, model_label, quiet_logs,
                               resolve_bench_model, set_threads)

QUESTIONS = ["What is the capital of France?", "How many legs does a spider have?",
             "What color is the sky on a clear day?", "Name the largest planet in the solar system.",
             "What is 2 plus 2?", "Who wrote Romeo and Juliet?", "What language is spoken in Brazil?",
             "What is the boiling point of water in Celsius?"]


def _runner(llm: Any) -> Any:
    return engine_model_runner(llm.llm_engine)


def run(model_dir: str, kv_cache_dtype: str, args: argparse.Namespace) -> tuple[list[Any], int, list[Any]]:
    """(completions, KV bytes per token, the layers' caches when asked for) of one engine with `kv_cache_dtype`."""
    import vx

    llm = vx.LLM(model_dir, dtype=args.dtype, device=args.device, kv_cache_dtype=kv_cache_dtype,
                 max_model_len=512, kv_cache_memory_bytes=2**27, enable_prefix_caching=False)
    try:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                     add_generation_prompt=True) for q in QUESTIONS]
        params = vx.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=1, ignore_eos=True)
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        runner = _runner(llm)
        per_token = runner.kv_cache_bytes_per_block() // runner.block_size
        caches = [c.clone() for c in runner.kv_caches] if kv_cache_dtype == "auto" else []
        return outs, per_token, caches
    finally:
        llm.shutdown()


def round_trip_errors(caches: list[Any], kv_cache_dtype: str) -> tuple[float, float]:
    """rms error / rms of the cached keys and of the values (their written rows) through the format and back."""
    import torch

    from vx.gpu.attention.kv_format import kv_cache_format

    fmt = kv_cache_format(kv_cache_dtype)
    errs = []
    for part in (0, 1):
        rows = torch.cat([c[part].reshape(-1, c.shape[-1]).float() for c in caches])
        rows = rows[rows.abs().amax(-1) > 0]  # the slots the questions wrote
        back = fmt.load(fmt.store(rows, fmt.cache_dtype(torch.float32)), torch.float32)
        errs.append(float((back - rows).pow(2).mean().sqrt() / rows.pow(2).mean().sqrt()))
    return errs[0], errs[1]


def time_attention(hf_config: Any, kv_dtypes: list[str], args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds of one decode step's attention over all layers, per round, for each KV-cache dtype."""
    import random

    import torch

    from vx.config import hf_head_dim, hf_num_kv_heads
    from vx.gpu.attention import CommonAttentionMetadata, get_attn_backend
    from vx.gpu.attention.kv_format import kv_cache_format
    from vx.platform import torch_dtype

    dtype = torch_dtype(args.dtype)
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    heads, kv_heads = int(hf_config.num_attention_heads), hf_num_kv_heads(hf_config)
    head_dim, layers, block = hf_head_dim(hf_config), int(hf_config.num_hidden_layers), 16
    n, ctx = args.attention_batch, args.attention_context
    per_seq = -(-ctx // block)
    blocks = list(range(1, n * per_seq + 1))
    random.Random(0).shuffle(blocks)  # scattered blocks, as a busy cache has them
    table = torch.tensor(blocks, dtype=torch.int32).view(n, per_seq)
    lens = torch.full((n,), ctx, dtype=torch.int32)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    slots = table[:, -1].long() * block + (ctx - 1) % block
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=lens.to(device), seq_lens_cpu=lens,
        block_table=table.to(device), slot_mapping=slots.to(device), num_reqs=n, num_actual_tokens=n,
        max_query_len=1, max_seq_len=ctx, block_size=block)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(n, heads * head_dim, generator=gen).to(device, dtype)
    k, v = (torch.randn(n, kv_heads * head_dim, generator=gen).to(device, dtype) for _ in range(2))
    steps = {}
    for kv in kv_dtypes:
        fmt = kv_cache_format(kv)
        backend = get_attn_backend("auto", device, dtype=dtype, head_dim=head_dim, block_size=block,
                                   kv_cache_dtype=kv)
        impl = backend.get_impl_cls()(heads, head_dim, head_dim ** -0.5, kv_heads, kv_cache_dtype=kv)
        # One random float cache, stored in the format, copied per layer.
        values = torch.randn(backend.get_kv_cache_shape(n * per_seq + 1, block, kv_heads, head_dim), generator=gen)
        cache = fmt.store(values.to(dtype), fmt.cache_dtype(dtype)).to(device)
        caches = [cache] + [cache.clone() for _ in range(layers - 1)]
        md = backend.build_metadata(common)
        steps[kv] = lambda impl=impl, caches=caches, md=md: [impl.forward(None, q, k, v, c, md) for c in caches]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {kv: [] for kv in kv_dtypes}
    for r in range(args.attention_rounds):
        # Each round starts one dtype later: none always runs first.
        for kv in kv_dtypes[r % len(kv_dtypes):] + kv_dtypes[:r % len(kv_dtypes)]:
            sync()
            t0 = time.perf_counter()
            steps[kv]()
            sync()
            times[kv].append(time.perf_counter() - t0)
    return times


def agreement(ref: list[Any], got: list[Any]) -> tuple[int, list[int], float]:
    """(generations keeping every reference token, tokens kept by each, max |log-probability shift| before parting)."""
    kept, shift = [], 0.0
    for a, b in zip(ref, got):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        kept.append(n)
        for j in range(n):
            tok = a.token_ids[j]
            shift = max(shift, abs(a.logprobs[j][tok].logprob - b.logprobs[j][tok].logprob))
    return sum(k == len(a.token_ids) for k, a in zip(kept, ref)), kept, shift


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vx bench kv_cache_dtype", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--kv-cache-dtypes", default="auto,fp8_e4m3,int8", help="the first is the reference")
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per question")
    ap.add_argument("--attention-batch", type=int, default=64, help="decoding sequences of the attention timing")
    ap.add_argument("--attention-context", type=int, default=300, help="tokens of each of them")
    ap.add_argument("--attention-rounds", type=int, default=21, help="rounds of the attention timing (0: none)")
    args = ap.parse_args(argv)
    quiet_logs()
    set_threads(args.threads)
    model_dir = resolve_bench_model(args.model)
    kv_dtypes = [k.strip() for k in args.kv_cache_dtypes.split(",") if k.strip()]
    results = {kv: run(model_dir, kv, args) for kv in kv_dtypes}
    ref_outs, ref_bytes, _ = results[kv_dtypes[0]]
    caches = results["auto"][2] if "auto" in results else run(model_dir, "auto", args)[2]
    table = Table(f"KV-cache dtype: {model_label(args.model, model_dir)}, {args.dtype}, {len(QUESTIONS)} questions, "
                  f"{args.max_tokens} greedy tokens", ["kv_cache_dtype", "KV bytes/token", f"vs {kv_dtypes[0]}",
                                                      "K rms error", "V rms error", "generations kept",
                                                      "median tokens kept", "max logprob shift"])
    for kv in kv_dtypes:
        outs, per_token, _ = results[kv]
        k_err, v_err = round_trip_errors(caches, kv)
        kept_all, kept, shift = agreement(ref_outs, outs)
        table.add(kv, per_token, f"{per_token / ref_bytes:.2f}x", f"{100 * k_err:.2f}%", f"{100 * v_err:.2f}%",
                  f"{kept_all}/{len(outs)}", float(statistics.median(kept)), shift)
    table.notes.append("rms error: of a round trip through the format of the keys/values the float engine cached, "
                       "relative to their rms; kept: tokens equal to the reference's before the first that differs; "
                       "logprob shift: of the reference's token, on the shared prefix")
    table.print()
    if args.attention_rounds > 0:
        from vx.config import EngineArgs

        hf_config = EngineArgs(model=model_dir, device=args.device).create_config().model_config.hf_config
        times = time_attention(hf_config, kv_dtypes, args)
        base = statistics.median(times[kv_dtypes[0]])
        label = model_label(args.model, model_dir)
        table = Table(f"Decode attention, all {hf_config.num_hidden_layers} layers: {label}, {args.dtype}, "
                      f"batch {args.attention_batch}, context {args.attention_context}",
                      ["kv_cache_dtype", "KV cache (MiB)", "ms per step", "IQR (ms)", f"vs {kv_dtypes[0]}"])
        for kv in kv_dtypes:
            quart = statistics.quantiles(times[kv], n=4) if len(times[kv]) > 1 else times[kv] * 3
            table.add(kv, results[kv][1] * args.attention_batch * args.attention_context / 2**20,
                      statistics.median(times[kv]) * 1000, f"{quart[0] * 1000:.0f}-{quart[2] * 1000:.0f}",
                      f"{base / statistics.median(times[kv]):.2f}x")
        table.notes.append(f"median over {args.attention_rounds} rounds, the dtypes taking turns; each layer its own "
                           "cache; the backend 'auto' picks; 'vs' > 1x is faster")
        table.print()


if __name__ == "__main__":
    main()
