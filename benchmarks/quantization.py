"""Quantized weights: memory, load time and speed per format, vx beside its float path and llama.cpp, in one run.

    python -m benchmarks.quantization                        # the default model's Q4_1 GGUF file
    python -m benchmarks.quantization --gguf path/to/model.gguf --rounds 5
    python -m benchmarks.quantization --formats gguf,float,llama.cpp --decode-tokens 32 --num-requests 8

Formats (`--formats`, all by default):
- `gguf`: vx on the GGUF file as it is (its tensors stay quantized);
- `float`: vx on the same weights dequantized to float (by transformers, saved once under the bench cache);
- `int8`, `int4`: vx quantizing that float checkpoint at load (`quantization="int8" | "int4"`);
- `llama.cpp`: llama-cpp-python on the same GGUF file (skipped, with the reason, when it is not installed).

Each format runs in a fresh child process, the formats interleaved, `--rounds` times; the tables give the median
and the spread (min-max) of each figure. Per format: weight bytes (the tensors the model holds: packed weights,
scales, float tensors), load time (building the engine from the files), engine RSS (the process's resident memory
once loaded, above the same process after importing torch and vx), batch-1 decode tokens/s (greedy, EOS ignored,
after the first token) and the throughput of `--num-requests` requests at once (tokens/s). llama-cpp-python runs
one sequence at a time: its throughput is the requests one after another.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (Table, bench_cache_dir, engine_model_runner, interleaved_rounds, machine_description,
                               median_spread, quiet_logs, ratio, rss_bytes, run_child)

FORMATS = ("gguf", "float", "int8", "int4", "llama.cpp")
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


# --------------------------------------------------------------------------------------------- the child
def weight_bytes(model: Any) -> int:
    """Bytes of the weights a model holds: its parameters and buffers, and the packed kernel weights its layers'
    quantization methods keep (anything with `nbytes` among a layer's attributes, or in a list of them), each
    counted once. The KV cache, which attention layers hold too, is not a weight."""
    import torch

    seen: set[int] = set()
    total = 0
    for module in model.modules():
        named = list(module._parameters.items()) + list(module._buffers.items()) + list(vars(module).items())
        values = [v for k, v in named if k != "kv_cache"]
        values += [item for v in values if isinstance(v, (list, tuple)) for item in v]
        for value in values:
            if value is None or id(value) in seen or isinstance(value, (torch.nn.Module, dict, list, tuple)):
                continue
            if isinstance(value, torch.Tensor) or isinstance(getattr(value, "nbytes", None), int):
                seen.add(id(value))
                total += value.nbytes
    return total


def run_vx(fmt: str, model: str, decode_tokens: int, num_requests: int, output_len: int, dtype: str) -> dict:
    """Load and measure one vx format in this process."""
    import torch  # noqa: F401 - the baseline is a process that has imported torch

    import vx

    quiet_logs()
    base = rss_bytes()
    args: dict[str, Any] = dict(dtype=dtype, device="cpu", max_model_len=1024, num_kv_blocks=256, block_size=16,
                                max_num_seqs=max(num_requests, 1))
    if fmt in ("int8", "int4"):
        args["quantization"] = fmt
    t0 = time.perf_counter()
    llm = vx.LLM(model, **args)
    load_s = time.perf_counter() - t0
    runner = engine_model_runner(llm.llm_engine)
    result = {"weight_bytes": weight_bytes(runner.model), "load_s": load_s}
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate([PROMPT], vx.SamplingParams(max_tokens=4, **greedy), use_tqdm=False)  # warm up
    result["rss_bytes"] = rss_bytes() - base
    t0 = time.perf_counter()
    llm.generate([PROMPT], vx.SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate([PROMPT], vx.SamplingParams(max_tokens=decode_tokens + 1, **greedy), use_tqdm=False)
    result["decode_tok_s"] = decode_tokens / max(time.perf_counter() - t0 - first, 1e-9)
    prompts = [f"{PROMPT} ({i})" for i in range(num_requests)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, vx.SamplingParams(max_tokens=output_len, **greedy), use_tqdm=False)
    result["throughput_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
    result["rss_bytes"] = max(result["rss_bytes"], rss_bytes() - base)
    llm.shutdown()
    return result


def run_llama_cpp(gguf: str, decode_tokens: int, num_requests: int, output_len: int, threads: int) -> dict:
    """Load and measure llama-cpp-python on the GGUF file in this process."""
    import torch  # noqa: F401 - the same baseline as vx's

    import vx  # noqa: F401

    base = rss_bytes()
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=gguf, n_ctx=1024, n_threads=threads, n_batch=512, verbose=False, use_mmap=True)
    load_s = time.perf_counter() - t0
    no_eos = {llm.token_eos(): -100.0}  # ignore EOS, as vx's runs do
    llm.create_completion(PROMPT, max_tokens=4, temperature=0.0, logit_bias=no_eos)  # warm up
    t0 = time.perf_counter()
    llm.create_completion(PROMPT, max_tokens=1, temperature=0.0, logit_bias=no_eos)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = llm.create_completion(PROMPT, max_tokens=decode_tokens + 1, temperature=0.0, logit_bias=no_eos)
    decode_s = time.perf_counter() - t0 - first
    generated = out["usage"]["completion_tokens"] - 1
    t0 = time.perf_counter()
    total = 0
    for i in range(num_requests):  # one at a time: the Python package has no parallel sequences
        out = llm.create_completion(f"{PROMPT} ({i})", max_tokens=output_len, temperature=0.0, logit_bias=no_eos)
        total += out["usage"]["completion_tokens"]
    throughput = total / (time.perf_counter() - t0)
    rss = rss_bytes() - base
    # llama.cpp maps the file: its weights are the file's tensor data.
    return {"weight_bytes": os.path.getsize(gguf), "load_s": load_s, "rss_bytes": rss,
            "decode_tok_s": generated / max(decode_s, 1e-9), "throughput_tok_s": throughput}


def _child(ns: argparse.Namespace) -> None:
    if ns.format == "llama.cpp":
        result = run_llama_cpp(ns.gguf, ns.decode_tokens, ns.num_requests, ns.output_len, ns.threads or 2)
    else:
        model = ns.gguf if ns.format == "gguf" else ns.float_dir
        result = run_vx(ns.format, model, ns.decode_tokens, ns.num_requests, ns.output_len, ns.dtype)
    print("RESULT " + json.dumps(result), flush=True)


# -------------------------------------------------------------------------------------------- the parent
def float_checkpoint(gguf: str) -> str:
    """The GGUF file's weights dequantized by transformers into a float32 safetensors directory (made once)."""
    import hashlib

    st = os.stat(gguf)
    key = hashlib.sha256(f"{os.path.realpath(gguf)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = os.path.join(bench_cache_dir(), f"float-{os.path.basename(gguf).removesuffix('.gguf')}-{key}")
    mark = os.path.join(target, ".vx-bench-complete")
    if os.path.isfile(mark):
        return target
    print(f"dequantizing {gguf} to float once, into {target} ...", file=sys.stderr, flush=True)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf))
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    os.makedirs(target, exist_ok=True)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(target, "model.safetensors"))
    cfg = config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(model).__name__]
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(cfg, f)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(target)
    with open(mark, "w"):
        pass
    return target


def _run_child(fmt: str, ns: argparse.Namespace, float_dir: str) -> dict | str:
    argv = ["--child", "--format", fmt, "--gguf", ns.gguf, "--float-dir", float_dir, "--decode-tokens",
            str(ns.decode_tokens), "--num-requests", str(ns.num_requests), "--output-len", str(ns.output_len),
            "--dtype", ns.dtype]
    if ns.threads:
        argv += ["--threads", str(ns.threads)]
    return run_child("benchmarks.quantization", argv, ns.threads)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vx bench quantization", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="a GGUF file (default: the default model's Q4_1 file)")
    ap.add_argument("--float-model", default=None,
                    help="a float checkpoint of the same weights (default: the GGUF dequantized by transformers)")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of every format (default 3)")
    ap.add_argument("--decode-tokens", type=int, default=64, help="batch-1 decode length (default 64)")
    ap.add_argument("--num-requests", type=int, default=32, help="requests of the throughput run (default 32)")
    ap.add_argument("--output-len", type=int, default=64, help="tokens per throughput request (default 64)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="vx's activations")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for every engine (default: all)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--format", help=argparse.SUPPRESS)
    ap.add_argument("--float-dir", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        _child(ns)
        return
    from vx.config.model_source import default_model_file

    ns.gguf = os.path.abspath(ns.gguf) if ns.gguf else default_model_file()
    formats = [f.strip() for f in ns.formats.split(",") if f.strip()]
    unknown = set(formats) - set(FORMATS)
    if unknown:
        raise SystemExit(f"unknown format(s) {', '.join(sorted(unknown))}; choose from {', '.join(FORMATS)}")
    if "llama.cpp" in formats:
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            print("llama.cpp skipped: llama-cpp-python is not installed (pip install llama-cpp-python; "
                  "see docs/quantization.md for the build flags)", file=sys.stderr)
            formats.remove("llama.cpp")
    float_dir = ns.float_model or (float_checkpoint(ns.gguf) if set(formats) & {"float", "int8", "int4"} else "")
    results, failures = interleaved_rounds(formats, ns.rounds, lambda fmt, _round: _run_child(fmt, ns, float_dir))
    table = Table(f"Quantized weights: {os.path.basename(ns.gguf)}, vx {ns.dtype} activations",
                  ["format", "weight MiB", "load s", "engine RSS MiB", "batch-1 tok/s", "vs float",
                   f"{ns.num_requests} req tok/s", "vs float"])
    base = results.get("float") or []
    base_decode = statistics.median(r["decode_tok_s"] for r in base) if base else float("nan")
    base_tp = statistics.median(r["throughput_tok_s"] for r in base) if base else float("nan")
    for fmt in formats:
        runs = results[fmt]
        if not runs:
            table.add(fmt, failures.get(fmt, "no result"))
            continue
        mib = 1 / 2**20
        weights, _ = median_spread([r["weight_bytes"] for r in runs], mib)
        load, load_spread = median_spread([r["load_s"] for r in runs])
        rss, rss_spread = median_spread([r["rss_bytes"] for r in runs], mib)
        decode, decode_spread = median_spread([r["decode_tok_s"] for r in runs])
        tp, tp_spread = median_spread([r["throughput_tok_s"] for r in runs])
        table.add(fmt, weights, f"{load:.2f} ({load_spread})", f"{rss:.0f} ({rss_spread})",
                  f"{decode:.1f} ({decode_spread})", ratio(decode, base_decode), f"{tp:.1f} ({tp_spread})",
                  ratio(tp, base_tp))
    table.notes.append(f"Medians of {ns.rounds} interleaved rounds (spread min-max), each format in a fresh process. "
                       f"Machine: {machine_description()}; threads: {ns.threads or 'all'}.")
    table.notes.append("engine RSS: the process's resident memory once loaded and run, above the same process after "
                       "importing torch and vx (KV cache: 256 blocks of 16 tokens for vx, n_ctx=1024 for llama.cpp).")
    if "llama.cpp" in formats:
        table.notes.append("llama.cpp: llama-cpp-python runs the requests one after another (no parallel sequences).")
    for fmt, why in failures.items():
        table.notes.append(f"{fmt}: {why}")
    table.print()


if __name__ == "__main__":
    main()
