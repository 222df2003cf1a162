"""instructor on an embedded vx: a pydantic model out of the in-process client's tool call.

    pip install instructor
    python examples/integrations/with_instructor.py
"""

from __future__ import annotations

import anyio
import instructor
from pydantic import BaseModel

import vx


class City(BaseModel):
    name: str
    country: str


async def main() -> None:
    async with vx.AsyncLLM() as llm:
        client = instructor.from_openai(vx.openai_client(llm))
        city = await client.chat.completions.create(
            model=vx.DEFAULT_MODEL, response_model=City, max_tokens=64, temperature=0.0, max_retries=1,
            messages=[{"role": "user", "content": "Which city is the capital of France?"}])
        print(repr(city))


if __name__ == "__main__":
    anyio.run(main)
