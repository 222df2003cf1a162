"""Many concurrent streams on one engine; some are cancelled midway, and the engine frees them.

    python examples/concurrent_streams.py
"""

from __future__ import annotations

import random

import anyio

import vx

TOPICS = ["the sea", "mountains", "a city at night", "autumn", "a robot", "coffee", "the moon", "trains"]


async def main(num_streams: int = 16) -> None:
    rng = random.Random(0)
    done: dict[int, str] = {}
    cancelled: list[int] = []

    async with vx.AsyncLLM() as llm:
        async def one(i: int) -> None:
            params = vx.SamplingParams(temperature=0.8, max_tokens=40, seed=i)
            messages = [{"role": "user", "content": f"Write one sentence about {TOPICS[i % len(TOPICS)]}."}]
            text = []
            if i % 4 == 3:  # every fourth stream gives up after a few tokens
                limit = rng.randint(1, 5)
                async for tok in llm.chat(messages, params):
                    text.append(tok)
                    if len(text) >= limit:
                        cancelled.append(i)
                        break  # leaving the loop aborts the request in the engine
                return
            async for tok in llm.chat(messages, params):
                text.append(tok)
            done[i] = "".join(text)

        async with anyio.create_task_group() as tg:
            for i in range(num_streams):
                tg.start_soon(one, i)

        for i in sorted(done):
            print(f"[{i:2d}] {done[i].strip()}")
        print(f"cancelled: {sorted(cancelled)}")
        stats = await llm.stats()
        print(f"engine after all: running={stats.num_running} waiting={stats.num_waiting} "
              f"kv_blocks_in_use={stats.kv_blocks_in_use}")


if __name__ == "__main__":
    anyio.run(main)
