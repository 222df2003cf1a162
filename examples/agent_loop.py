"""An agent-style loop: chat turns, a tool call parsed from the model's reply, a timeout per turn.

The model is asked to answer arithmetic with a tool call `CALL calculator(<expression>)`; the loop runs
the tool, feeds the result back as a message, and asks for the final answer. Each model turn runs
under `anyio.fail_after`, whose cancellation aborts the request in the engine.

    python examples/agent_loop.py
"""

from __future__ import annotations

import ast
import operator
import re

import anyio

import vx

SYSTEM = ("You are a helpful assistant with a calculator. To compute something, reply with exactly one "
          "line: CALL calculator(<expression>). After you get the result, answer the user briefly.")
TOOL_CALL = re.compile(r"CALL\s+calculator\((?P<expr>[^)]*)\)")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """Evaluate + - * / on numbers (a safe, tiny tool)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"unsupported expression: {expression!r}")

    try:
        return str(ev(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"


async def turn(llm: vx.AsyncLLM, messages: list[dict], timeout_s: float) -> str:
    """One model turn, streamed; gives up (and aborts the request) after `timeout_s`."""
    params = vx.SamplingParams(temperature=0.0, max_tokens=64)
    parts: list[str] = []
    try:
        with anyio.fail_after(timeout_s):
            async for tok in llm.chat(messages, params):
                parts.append(tok)
    except TimeoutError:
        parts.append(" [timed out]")
    return "".join(parts).strip()


async def main(question: str = "What is 37 * 12 + 5?", timeout_s: float = 60.0) -> None:
    async with vx.AsyncLLM() as llm:
        # One worked exchange shows the tool-call format: a 135M model follows an example far better
        # than an instruction.
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "What is 6 * 7?"},
                    {"role": "assistant", "content": "CALL calculator(6 * 7)"},
                    {"role": "user", "content": "The calculator returned 42."},
                    {"role": "assistant", "content": "6 * 7 = 42."},
                    {"role": "user", "content": question}]
        print(f"user: {question}")
        for _ in range(3):  # at most three model turns
            reply = await turn(llm, messages, timeout_s)
            print(f"assistant: {reply}")
            messages.append({"role": "assistant", "content": reply})
            call = TOOL_CALL.search(reply)
            if call is None:
                break
            result = calculator(call.group("expr"))
            print(f"tool: calculator({call.group('expr')}) = {result}")
            messages.append({"role": "user", "content": f"The calculator returned {result}."})
        # A deliberately tiny budget shows a timeout cancelling a turn cleanly.
        print("short-timeout turn:", await turn(llm, messages + [
            {"role": "user", "content": "Now explain your steps in detail."}], timeout_s=0.05))
        stats = await llm.stats()
        print(f"engine: running={stats.num_running} kv_blocks_in_use={stats.kv_blocks_in_use}")


if __name__ == "__main__":
    anyio.run(main)
