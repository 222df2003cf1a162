"""openai-agents on an embedded vx: its default Responses model, given the in-process client.

    pip install openai-agents
    python examples/integrations/with_openai_agents.py
"""

from __future__ import annotations

import anyio
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

import vx


@function_tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    print(f"get_weather called with {city}")
    return f"Sunny, 21 C in {city}"


async def main() -> None:
    set_tracing_disabled(True)  # traces go to OpenAI's servers by default
    async with vx.AsyncLLM() as llm:
        agent = Agent(name="weather", instructions="Answer with the tool's result.", tools=[get_weather],
                      model=OpenAIResponsesModel(model=vx.DEFAULT_MODEL, openai_client=vx.openai_client(llm)),
                      # A 135M model needs the push to call the tool, and is no judge of when to stop calling
                      # it: the tool's result is the answer.
                      model_settings=ModelSettings(tool_choice="required", temperature=0.0, max_tokens=64),
                      tool_use_behavior="stop_on_first_tool")
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        print("final output:", result.final_output)


if __name__ == "__main__":
    anyio.run(main)
