"""LangChain's `ChatOpenAI` (langchain-openai) on an embedded vx, through the in-process client.

    pip install langchain-openai
    python examples/integrations/with_langchain.py
"""

from __future__ import annotations

import anyio
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI

import vx


def chat_model(client, **kwargs) -> ChatOpenAI:
    """A ChatOpenAI whose async calls go to `client` (`use_responses_api=True` takes /v1/responses)."""
    return ChatOpenAI(model=vx.DEFAULT_MODEL, api_key="unused", base_url=str(client.base_url),
                      root_async_client=client, async_client=client.chat.completions, temperature=0.0, **kwargs)


async def main() -> None:
    async with vx.AsyncLLM() as llm:
        client = vx.openai_client(llm)
        messages = [SystemMessage("Answer in one short sentence."), HumanMessage("What is the capital of France?")]

        print("--- ainvoke ---")
        print((await chat_model(client, max_tokens=32).ainvoke(messages)).content)

        print("--- astream ---")
        async for chunk in chat_model(client, max_tokens=32).astream(messages):
            print(chunk.content, end="", flush=True)
        print()

        print("--- tool call, through the Responses API ---")

        def get_weather(city: str) -> str:
            """The current weather in a city."""
            return "Sunny"

        model = chat_model(client, max_tokens=64, use_responses_api=True)
        reply = await model.bind_tools([get_weather], tool_choice="get_weather").ainvoke(
            [HumanMessage("What is the weather in Paris?")])
        print("tool calls:", [(c["name"], c["args"]) for c in reply.tool_calls])


if __name__ == "__main__":
    anyio.run(main)
