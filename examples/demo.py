"""Demo: build a tiny random-weight model and generate with vx (replaced by the default model later)."""

from __future__ import annotations

import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests", "models"), os.path.join(HERE, "..", "tests", "client")]

import vx  # noqa: E402


def main() -> None:
    from tiny_models import make_tiny_model
    from tiny_tokenizer import make_tiny_tokenizer

    with tempfile.TemporaryDirectory() as d:
        make_tiny_model("qwen3", d, eos_token_id=0, bos_token_id=0, pad_token_id=0)
        make_tiny_tokenizer(d)
        llm = vx.LLM(d)
        prompts = [f"The capital of France is number {i}" for i in range(32)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, vx.SamplingParams(temperature=0.8, max_tokens=32, seed=0))
        dt = time.perf_counter() - t0
        for o in outs[:3]:
            print(repr(o.prompt), "->", repr(o.outputs[0].text))
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"{len(outs)} requests, {n} tokens in {dt:.2f}s ({n / dt:.0f} tok/s); stats: {llm.stats()}")


if __name__ == "__main__":
    main()
