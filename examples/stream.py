"""The core loop of vx: `async for tok in llm.stream(prompt)`, on the default model.

    python examples/stream.py
"""

from __future__ import annotations

import anyio

import vx


async def main() -> None:
    async with vx.AsyncLLM() as llm:
        params = vx.SamplingParams(temperature=0.0, max_tokens=48)
        print("The capital of France is", end="", flush=True)
        async for tok in llm.stream("The capital of France is", params):
            print(tok, end="", flush=True)
        print()

        print("--- chat ---")
        async for tok in llm.chat([{"role": "user", "content": "Say hello in French."}], params):
            print(tok, end="", flush=True)
        print()


if __name__ == "__main__":
    anyio.run(main)
