"""langgraph on an embedded vx: a two-node graph (model, then tools) with langchain-openai's ChatOpenAI over the
in-process client.

    pip install langgraph langchain-openai
    python examples/integrations/with_langgraph.py
"""

from __future__ import annotations

import anyio
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

import vx


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"Sunny, 21 C in {city}"


async def main() -> None:
    async with vx.AsyncLLM() as llm:
        client = vx.openai_client(llm)
        model = ChatOpenAI(model=vx.DEFAULT_MODEL, api_key="unused", base_url=str(client.base_url),
                           root_async_client=client, async_client=client.chat.completions, temperature=0.0,
                           max_tokens=64).bind_tools([get_weather], tool_choice="get_weather")

        async def call_model(state: MessagesState) -> dict:
            return {"messages": [await model.ainvoke(state["messages"])]}

        graph = StateGraph(MessagesState)
        graph.add_node("model", call_model)
        graph.add_node("tools", ToolNode([get_weather]))
        graph.add_edge(START, "model")
        graph.add_edge("model", "tools")
        graph.add_edge("tools", END)
        result = await graph.compile().ainvoke({"messages": [HumanMessage("What is the weather in Paris?")]})
        print("tool calls:", result["messages"][1].tool_calls)
        print("graph answer:", result["messages"][-1].content)


if __name__ == "__main__":
    anyio.run(main)
