"""The official `openai` client on an embedded vx: no server, no port (`vx.openai_client(llm)`).

    python examples/integrations/with_openai.py
"""

from __future__ import annotations

import anyio

import vx

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


async def main() -> None:
    async with vx.AsyncLLM() as llm:
        client = vx.openai_client(llm)  # an openai.AsyncOpenAI served by this process's engine

        print("--- chat, streamed ---")
        stream = await client.chat.completions.create(
            model=vx.DEFAULT_MODEL, messages=[{"role": "user", "content": "Name the capital of France."}],
            max_tokens=32, temperature=0.0, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
        print()

        print("--- responses, with a function tool ---")
        question = "What is the weather in Paris?"
        out = await client.responses.create(model=vx.DEFAULT_MODEL, input=question, tools=[WEATHER],
                                            tool_choice="required", max_output_tokens=64, temperature=0.0)
        call = next(item for item in out.output if item.type == "function_call")
        print(f"tool call: {call.name}({call.arguments})")
        answer = await client.responses.create(
            model=vx.DEFAULT_MODEL, tools=[WEATHER], tool_choice="none", max_output_tokens=48, temperature=0.0,
            input=[{"role": "user", "content": question}, call,
                   {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
        print("answer:", answer.output_text)
        await client.close()  # the engine keeps running until `async with` ends


if __name__ == "__main__":
    anyio.run(main)
