"""Every model family and engine feature on one device, each case isolated: a failure prints its traceback and the
next case runs. Made for a short lease of a GPU, where one run must find every bug it can, not the first one.

    python -m benchmarks.cuda_probe --device cuda          # on the GPU machine (gpu_check.sh runs it)
    python -m benchmarks.cuda_probe --device cpu --families qwen3   # a smoke run here

Cases, float32 unless named (tiny seeded models from tests/support, 10 prompts with a shared prefix, 24 tokens):
- greedy vs Hugging Face `generate` on the same device, token for token, per family, with the engine's decode
  graphs (CUDA graphs on CUDA), and eager under a 16-token budget with forced preemption;
- the attention backends one by one (torch, triton, flash_attn) on the Qwen3 model;
- seeded sampling (same seed, same tokens twice), logprobs and prompt logprobs, embeddings, an fp8 KV cache, bf16,
  and an `AsyncLLM` (engine in its own process) streaming.
Prints one line per case (ok / FAILED / skipped) and a summary; exits 1 when a case failed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.tiny_models import greedy_prompts  # noqa: E402 - after the repository root is on the path

MAX_NEW = 24


def _hf_greedy(model_dir: str, device: str) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    # Eager attention: the reference every family's features reach (some transformers versions send Gemma 2 to
    # SDPA, which skips its attention soft cap).
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").to(device).eval()
    outs = []
    for p in greedy_prompts():
        with torch.no_grad():
            gen = model.generate(torch.tensor([p], device=device), max_new_tokens=MAX_NEW, do_sample=False,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long, device=device))
        outs.append(gen[0, len(p):].tolist())
    return outs


def _vx_greedy(model_dir: str, device: str, **engine_args: Any) -> list[list[int]]:
    import vx

    llm = vx.LLM(model_dir, device=device, **{"dtype": "float32", **engine_args})
    try:
        params = vx.SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
        outs = llm.generate(greedy_prompts(), params, use_tqdm=False)
        stats = llm.stats()
        assert stats.kv_blocks_in_use == 0, f"{stats.kv_blocks_in_use} KV blocks still held after the batch"
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


def _same(got: list[list[int]], want: list[list[int]]) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            first = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            raise AssertionError(f"prompt {i} differs from token {first}:\n  vx {g}\n  hf {w}")


class Probe:
    """Runs cases, each isolated, and keeps the verdicts."""

    def __init__(self) -> None:
        self.results: list[tuple[str, str, float]] = []

    def case(self, name: str, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        try:
            note = fn()
            verdict = "ok" + (f" ({note})" if note else "")
        except _Skip as e:
            verdict = f"skipped ({e})"
        except BaseException as e:  # noqa: BLE001 - one case's failure, whatever it is, must not stop the probe
            if isinstance(e, KeyboardInterrupt):
                raise
            traceback.print_exc()
            verdict = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        dt = time.perf_counter() - t0
        self.results.append((name, verdict, dt))
        print(f"[{dt:6.1f}s] {name}: {verdict}", flush=True)


class _Skip(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    from tests.support.tiny_models import ENGINE_FAMILIES

    ap = argparse.ArgumentParser(prog="python -m benchmarks.cuda_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--families", default=",".join(ENGINE_FAMILIES), help="comma-separated (tests/support names)")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import logging

    logging.disable(logging.WARNING)
    import torch

    from tests.support.tiny_models import make_tiny_model
    from tests.support.tiny_tokenizer import make_tiny_tokenizer

    import vx

    device = args.device
    probe = Probe()
    root = tempfile.mkdtemp(prefix="vx-probe-")
    dirs: dict[str, str] = {}
    for fam in args.families.split(","):
        d = os.path.join(root, fam)
        make_tiny_model(fam, d, eos_token_id=0, bos_token_id=0, pad_token_id=0)
        make_tiny_tokenizer(d)
        dirs[fam] = d
    print(f"cuda probe on {device}: torch {torch.__version__}, "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}", flush=True)

    for fam, d in dirs.items():
        want: list[list[int]] = []

        def reference(d: str = d) -> None:
            want.extend(_hf_greedy(d, device))

        probe.case(f"{fam}: HF generate on {device}", reference)
        if not want:
            continue
        for label, engine_args in (("decode graphs", {}),
                                   ("eager, budget 16, forced preemption", {
                                       "enforce_eager": True, "max_num_batched_tokens": 16, "num_kv_blocks": 14,
                                       "block_size": 8, "max_model_len": 96})):
            probe.case(f"{fam}: greedy == HF, {label}",
                       lambda d=d, a=engine_args: _same(_vx_greedy(d, device, **a), want))

    model = dirs.get("qwen3") or next(iter(dirs.values()))
    for backend in ("torch", "triton", "flash_attn"):
        def backend_case(backend: str = backend) -> None:
            base = _vx_greedy(model, device, attention_backend="torch", enforce_eager=True)
            try:
                got = _vx_greedy(model, device, attention_backend=backend)
            except ValueError as e:
                if "unavailable" in str(e) and backend != "torch":
                    raise _Skip(str(e).splitlines()[0][:120]) from None
                raise
            _same(got, base)

        probe.case(f"attention backend {backend} == torch eager", backend_case)

    def seeded_sampling() -> str:
        outs = []
        for _ in range(2):
            llm = vx.LLM(model, device=device, dtype="float32")
            try:
                params = [vx.SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7 + i, max_tokens=MAX_NEW,
                                            logprobs=3) for i in range(6)]
                res = llm.generate(greedy_prompts()[:6], params, use_tqdm=False)
                outs.append([list(r.outputs[0].token_ids) for r in res])
                assert all(len(r.outputs[0].logprobs) == len(r.outputs[0].token_ids) for r in res)
            finally:
                llm.shutdown()
        assert outs[0] == outs[1], "the same seeds gave different tokens"
        return f"{len(set(map(tuple, outs[0])))} distinct outputs"

    probe.case("seeded sampling repeats, logprobs", seeded_sampling)

    def prompt_logprobs() -> str:
        llm = vx.LLM(model, device=device, dtype="float32", max_num_batched_tokens=16)
        try:
            res = llm.generate([greedy_prompts()[5]], vx.SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        finally:
            llm.shutdown()
        lps = res[0].prompt_logprobs
        assert lps is not None and len(lps) == len(greedy_prompts()[5]), "one entry per prompt token"
        return f"{len(lps)} positions"

    probe.case("prompt logprobs under a 16-token budget", prompt_logprobs)

    def embeddings() -> str:
        llm = vx.LLM(model, device=device, dtype="float32")
        try:
            res = llm.embed(["hello world", "a longer sentence to embed"])
        finally:
            llm.shutdown()
        norms = [float(torch.tensor(r.outputs.embedding).norm()) for r in res]
        assert all(abs(n - 1.0) < 1e-3 for n in norms), norms
        return f"dim {len(res[0].outputs.embedding)}"

    probe.case("embeddings", embeddings)

    def agreement_with_float32(**engine_args: Any) -> str:
        base = _vx_greedy(model, device)
        got = _vx_greedy(model, device, **engine_args)
        agree = sum(a == b for g, w in zip(got, base) for a, b in zip(g, w)) / sum(map(len, base))
        return f"{agree:.0%} of tokens as in float32"

    probe.case("fp8_e4m3 KV cache", lambda: agreement_with_float32(kv_cache_dtype="fp8_e4m3"))
    probe.case("bfloat16", lambda: agreement_with_float32(dtype="bfloat16"))

    def async_stream() -> str:
        async def run() -> str:
            async with vx.AsyncLLM(model, device=device, dtype="float32") as llm:
                text = ""
                async for delta in llm.stream("hello", vx.SamplingParams(temperature=0.0, max_tokens=16)):
                    text += delta
                return f"{len(text)} characters streamed"

        return asyncio.run(run())

    probe.case("AsyncLLM stream (engine process)", async_stream)

    failed = [r for r in probe.results if r[1].startswith("FAILED")]
    print(f"\nsummary: {len(probe.results) - len(failed)} of {len(probe.results)} cases ok or skipped", flush=True)
    for name, verdict, dt in probe.results:
        print(f"  {name}: {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
