"""pydantic-ai on an embedded vx: `OpenAIResponsesModel` over the in-process client, with a typed output.

    pip install "pydantic-ai-slim[openai]"
    python examples/integrations/with_pydantic_ai.py
"""

from __future__ import annotations

import anyio
from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider

import vx


class City(BaseModel):
    name: str
    country: str


async def main() -> None:
    async with vx.AsyncLLM() as llm:
        model = OpenAIResponsesModel(vx.DEFAULT_MODEL, provider=OpenAIProvider(openai_client=vx.openai_client(llm)))
        agent = Agent(model, output_type=City, model_settings={"temperature": 0.0, "max_tokens": 64})
        result = await agent.run("Which city is the capital of France?")
        print(repr(result.output))


if __name__ == "__main__":
    anyio.run(main)
