"""Offline throughput: vx beside Hugging Face `generate` on the same model and workload, in one run.

    python benchmarks/throughput.py                       # a random-weight small Qwen2-shaped model
    python benchmarks/throughput.py --model DIR --num-prompts 64 --dtype bfloat16

Prints generated tokens/s of each and the ratio vx / HF. Both generate exactly `--output-len` tokens
per request (EOS ignored), greedy, from the same random token-id prompts.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests", "models"), os.path.join(HERE, "..", "tests", "client")]


def build_random_model(dirpath: str) -> str:
    """A random-weight Qwen2-shaped model (hidden 512, 8 layers) with a small BPE tokenizer."""
    from tiny_models import make_tiny_model
    from tiny_tokenizer import make_tiny_tokenizer

    make_tiny_model("qwen2", dirpath, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=2, vocab_size=4096,
                    max_position_embeddings=4096, eos_token_id=0, bos_token_id=0, pad_token_id=0,
                    initializer_range=0.02)
    make_tiny_tokenizer(dirpath)
    return dirpath


def make_workload(n: int, vocab: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def run_vx(model: str, prompts, output_len: int, dtype: str) -> float:
    import vx

    llm = vx.LLM(model, dtype=dtype, device="cpu" if not _cuda() else "auto")
    params = vx.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.shutdown()
    return ntok / dt


def run_hf(model: str, prompts, output_len: int, dtype: str, batch_size: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    device = "cuda" if _cuda() else "cpu"
    m = AutoModelForCausalLM.from_pretrained(model, dtype=tdtype).to(device).eval()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0

    def batch_generate(batch):
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.no_grad():
            out = m.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False)
        return (out.shape[1] - width) * len(batch)

    batch_generate(prompts[:2])  # warm-up
    t0 = time.perf_counter()
    ntok = sum(batch_generate(prompts[i:i + batch_size]) for i in range(0, len(prompts), batch_size))
    return ntok / (time.perf_counter() - t0)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF model directory (default: a random-weight small Qwen2 model)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--min-prompt-len", type=int, default=16)
    ap.add_argument("--max-prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--hf-batch-size", type=int, default=16)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_random_model(tmp)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model).vocab_size
        prompts = make_workload(args.num_prompts, vocab, args.min_prompt_len, args.max_prompt_len)
        print(f"workload: {len(prompts)} prompts, {args.min_prompt_len}-{args.max_prompt_len} tokens in, "
              f"{args.output_len} out, {args.dtype}")
        vx_tps = run_vx(model, prompts, args.output_len, args.dtype)
        hf_tps = run_hf(model, prompts, args.output_len, args.dtype, args.hf_batch_size)
    print(f"vx:               {vx_tps:9.1f} generated tok/s")
    print(f"HF generate (bs={args.hf_batch_size}): {hf_tps:9.1f} generated tok/s")
    print(f"ratio vx / HF:    {vx_tps / hf_tps:9.2f}x")


if __name__ == "__main__":
    main()
