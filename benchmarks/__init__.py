"""vx's benchmark suite: each module measures vx beside its competitor (or the hardware limit) in one run.

Every benchmark is a module with `main(argv: list[str] | None = None) -> None`, so that `vx bench <name>`
(or `python -m benchmarks.<name>`) can run it; `run_all` runs them all with quick sizes.
"""

from __future__ import annotations

import importlib
from typing import Callable

BENCHMARKS: dict[str, str] = {
    "throughput": "offline tokens/s on a mixed workload, vx vs Hugging Face generate",
    "roofline": "GEMM GFLOP/s and memory bandwidth at the model's shapes; the decode-step lower bound",
    "quant_matmul": "weight-only int4/int8 matmuls (torch's ops, torchao, vx's C kernel) vs float F.linear",
    "gguf_matmul": "GGUF Q4_K/Q6_K weights read as stored vs repacked vs torch's int4 ops, 1.7B and 8B shapes",
    "decode_step": "one pure-decode step of a batch per attention backend (torch gather + SDPA vs the C kernel) and "
                   "KV-cache dtype",
    "prefill_chunk": "prompt tokens/s and step time per token budget (max_num_batched_tokens)",
    "kv_cache_dtype": "accuracy per byte of the 8-bit KV caches (fp8_e4m3, int8) beside the float cache",
    "engine_overhead": "scheduler + KV cache manager + input building time per request per step, no model",
    "prefix_caching": "time to first token of requests sharing a long prefix, prefix caching on vs off",
    "streaming": "TTFT and inter-token latency percentiles under Poisson arrivals, AsyncLLM vs in-process",
    "async_overhead": "TTFT and per-token latency of AsyncLLM over the process boundary vs the in-process engine",
    "startup": "time from AsyncLLM(...) to the first streamed token of a fresh engine (default model)",
    "hf_quantization": "int8/int4 at load and FP8 layouts vs the float path: weight bytes, logits error, matmul and "
                       "decode speed, engine RSS",
    "parallel": "one workload with the model whole, over 2 tensor-parallel ranks and over 2 pipeline stages (worker "
                "processes): step time, tokens/s and the communication share of a step",
    "run_all": "every benchmark above with quick sizes (--full: the issue's sizes), as a markdown report",
    "quantization": "per weight format: bytes, load time, RSS, batch-1 and batched tokens/s; float path and llama.cpp",
    "soak": "minutes of random streaming load with cancellations: front-end and engine RSS, start vs end",
    "gguf_memory": "engine RSS of a GGUF model run natively vs the same model expanded to float32 (default model)",
    "batch_throughput": "equal-length batches (32 and 128 requests x 128 tokens): vx vs HF generate's best padded "
                        "batch and llama.cpp with parallel slots; vx's engine RSS",
    "latency": "batch-1 time to first token (512-token prompt) and decode tokens/s, vx vs llama.cpp and HF generate",
    "greedy_check": "vx's greedy tokens against Hugging Face on the same weights: float32 exact, 16-bit top-1 "
                    "agreement (gpu_check.sh runs it on CUDA)",
    "fused_moe": "one MoE layer's experts on CUDA: the Triton grouped GEMM vs FusedMoE's eager loop (needs CUDA)",
    "vs_llama_cpp": "per model shape (default, 1.7B, 8B; one GGUF file each): batch-1 decode, 512-token prefill, 32 "
                    "concurrent requests, memory and bandwidth share, vx beside llama.cpp's programs and HF",
}


def get_main(name: str) -> Callable[[list[str] | None], None]:
    """The `main` function of benchmark `name` (a key of BENCHMARKS)."""
    if name not in BENCHMARKS:
        raise ValueError(f"Unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}.")
    return importlib.import_module(f"benchmarks.{name}").main


def run(name: str, argv: list[str] | None = None) -> None:
    """Run benchmark `name` with command-line arguments `argv`."""
    get_main(name)(argv)
