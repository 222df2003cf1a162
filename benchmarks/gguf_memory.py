"""Memory of a GGUF model run natively, beside the same model expanded to float (what vx did before: transformers'
dequantization saved as safetensors), in one run, with the same KV cache.

For each variant, interleaved and repeated: a fresh AsyncLLM, the engine process's RSS above a bare process that
imported torch (at start, and after one greedy chat answer), its peak RSS (VmHWM), the time to a ready engine, and
the answer's tokens per second (batch 1).

    vx bench gguf_memory                         # the default model, float32
    vx bench gguf_memory --model x.gguf --runs 5 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Table, bench_cache_dir, quiet_logs, ratio

MIB = 2**20


def float_copy(gguf_path: str, dtype: str = "float32") -> str:
    """The GGUF model as a safetensors directory in `dtype` (float32, bfloat16), made once under the bench cache:
    transformers dequantizes the file (the float path's checkpoint)."""
    from vx.config.model_source import ensure_gguf_config

    st = os.stat(gguf_path)
    target = os.path.join(bench_cache_dir(), f"{dtype}-{os.path.basename(gguf_path)}-{st.st_size}-{st.st_mtime_ns}")
    if os.path.isfile(os.path.join(target, "model.safetensors")):
        return target
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config_dir = ensure_gguf_config(gguf_path)
    partial = target + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(config_dir, partial)
    folder, name = os.path.split(os.path.realpath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding's tensor; safetensors refuses aliases
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(partial, "model.safetensors"))
    with open(os.path.join(partial, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config")
    with open(os.path.join(partial, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    os.replace(partial, target)
    return target


def bare_torch_rss() -> int:
    """RSS of a fresh process that has imported torch (the floor every engine process stands on)."""
    out = subprocess.run([sys.executable, "-c", "import torch, psutil; print(psutil.Process().memory_info().rss)"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


def _peak(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


async def one_run(model: str, engine_args: dict[str, Any], max_tokens: int) -> dict[str, float]:
    """Engine RSS at start and after one greedy chat answer of `max_tokens` tokens, peak RSS, seconds to a ready
    engine, and the answer's tokens per second (batch 1, prefill included)."""
    import psutil

    import vx

    t0 = time.perf_counter()
    async with vx.AsyncLLM(model, **engine_args) as llm:
        ready = time.perf_counter() - t0
        engine = psutil.Process(llm._client.engine.proc.pid)
        at_start = engine.memory_info().rss
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                 tokenize=False, add_generation_prompt=True)
        prompt = llm.tokenizer.encode(text, add_special_tokens=False)
        t1 = time.perf_counter()
        out = await llm.complete(prompt, vx.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        tok_s = len(out.outputs[0].token_ids) / (time.perf_counter() - t1)
        after = engine.memory_info().rss
        peak = _peak(engine.pid)
    return dict(ready=ready, start=at_start, after=after, peak=peak, tok_s=tok_s)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vx bench gguf_memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file (default: vx's default model)")
    ap.add_argument("--runs", type=int, default=3, help="fresh engines per variant, interleaved")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=1024, help="the KV cache holds one sequence this long")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32, help="length of the chat answer (tokens, EOS ignored)")
    ap.add_argument("--threads", type=int, default=None, help="accepted for run_all; unused here")
    args = ap.parse_args(argv)
    import anyio

    from vx.config.model_source import default_model_file, ensure_gguf_config

    quiet_logs()
    gguf_path = os.path.abspath(args.model) if args.model else default_model_file()
    variants = {"vx, GGUF natively": ensure_gguf_config(gguf_path), "vx, expanded to float32": float_copy(gguf_path)}
    blocks = -(-args.max_model_len // args.block_size) + 1
    engine_args = dict(dtype=args.dtype, device="cpu", max_model_len=args.max_model_len, block_size=args.block_size,
                       num_kv_blocks=blocks)
    bare = bare_torch_rss()
    results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for _ in range(args.runs):
        for name, model in variants.items():
            results[name].append(anyio.run(one_run, model, engine_args, args.max_tokens))

    def med(name: str, key: str, scale: float = MIB, minus: float = 0.0) -> float:
        return statistics.median((r[key] - minus) / scale for r in results[name])

    def spread(name: str, key: str, minus: float = 0.0) -> str:
        values = [(r[key] - minus) / MIB for r in results[name]]
        return f"{min(values):.0f}-{max(values):.0f}"

    table = Table(f"Engine memory of {os.path.basename(gguf_path)} ({args.dtype}, KV cache {blocks} blocks of "
                  f"{args.block_size}; MiB above a bare torch process of {bare / MIB:.0f} MiB)",
                  ["variant", "at start", f"after {args.max_tokens} tokens", "spread", "peak", "ready (s)", "tok/s"])
    for name in variants:
        table.add(name, med(name, "start", minus=bare), med(name, "after", minus=bare),
                  spread(name, "after", minus=bare), med(name, "peak", minus=bare), med(name, "ready", scale=1.0),
                  med(name, "tok_s", scale=1.0))
    native, expanded = variants
    table.add("ratio (native / float)", ratio(med(native, "start", minus=bare), med(expanded, "start", minus=bare)),
              ratio(med(native, "after", minus=bare), med(expanded, "after", minus=bare)), "",
              ratio(med(native, "peak", minus=bare), med(expanded, "peak", minus=bare)),
              ratio(med(native, "ready", scale=1.0), med(expanded, "ready", scale=1.0)),
              ratio(med(native, "tok_s", scale=1.0), med(expanded, "tok_s", scale=1.0)))
    table.notes.append(f"Medians of {args.runs} fresh engines per variant, run alternately; weights on disk: "
                       f"{os.path.getsize(gguf_path) / MIB:.0f} MiB GGUF, "
                       f"{os.path.getsize(os.path.join(variants[expanded], 'model.safetensors')) / MIB:.0f} MiB "
                       "float32 safetensors.")
    table.print()


if __name__ == "__main__":
    main()
