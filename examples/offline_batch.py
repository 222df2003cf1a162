"""Offline batch generation with `vx.LLM` (in-process engine, tqdm progress bar).

    python examples/offline_batch.py
"""

from __future__ import annotations

import time

import vx


def main() -> None:
    llm = vx.LLM()  # the default model
    questions = ["What is the capital of France?", "Name a prime number above 10.",
                 "What colour is the sky on a clear day?", "What do bees make?"] * 4
    t0 = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": q}] for q in questions],
                    vx.SamplingParams(temperature=0.0, max_tokens=48))
    dt = time.perf_counter() - t0
    for q, o in list(zip(questions, outs))[:4]:
        print(f"Q: {q}\nA: {o.outputs[0].text.strip()}\n")
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{len(outs)} requests, {n} generated tokens in {dt:.1f}s ({n / dt:.0f} tok/s)")
    print(llm.stats())
    llm.shutdown()


if __name__ == "__main__":
    main()
