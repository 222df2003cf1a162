"""smolagents on an embedded vx, from plain sync code: the sync in-process client starts the engine on a
background thread and stops it when closed.

    pip install smolagents
    python examples/integrations/with_smolagents.py
"""

from __future__ import annotations

from smolagents import OpenAIModel, ToolCallingAgent, tool

import vx


@tool
def get_weather(city: str) -> str:
    """The current weather in a city.

    Args:
        city: the city's name
    """
    print(f"get_weather called with {city}")
    return f"Sunny, 21 C in {city}"


def main() -> None:
    with vx.openai_client(vx.AsyncLLM(), sync=True) as client:  # openai.OpenAI; closing it stops the engine
        model = OpenAIModel(model_id=vx.DEFAULT_MODEL, client=client, temperature=0.0, max_tokens=128)
        agent = ToolCallingAgent(tools=[get_weather], model=model, max_steps=3, verbosity_level=0)
        print("final answer:", agent.run("Call get_weather to find the weather in Paris."))


if __name__ == "__main__":
    main()
