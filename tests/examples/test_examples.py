"""Every script in examples/ runs to its end on the default model, on CPU, and shows what it promises.

The agent-framework scripts in examples/integrations/ run here too: the `openai` and langchain-openai ones always
(their packages are in the test extra); the others only under `make examples`, which installs their frameworks
and sets VX_EXAMPLES=1 (they would add minutes and heavy packages to every CI run).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
INTEGRATIONS = os.path.join(EXAMPLES, "integrations")

# script -> lines its output must contain
EXPECTED = {
    "demo.py": ["Paris"],
    "stream.py": ["--- chat ---"],
    "concurrent_streams.py": ["cancelled: [3, 7, 11, 15]", "running=0 waiting=0 kv_blocks_in_use=0"],
    "agent_loop.py": ["tool: calculator(", "short-timeout turn: [timed out]", "running=0 kv_blocks_in_use=0"],
    "offline_batch.py": ["16 requests", "num_running=0, num_waiting=0", "kv_blocks_in_use=0"],
}


# examples/integrations/ script -> (lines its output must contain, whether it runs in every test run)
INTEGRATION_EXPECTED = {
    # The answer after the tool's output is the weak default model's paraphrase ("Sunny, ..." on the float path,
    # "quite pleasant ... 21 degrees" with int8 activations): only that it comes is checked.
    "with_openai.py": (["The capital of France is Paris", 'tool call: get_weather({"city": "Paris"})', "answer: "],
                       True),
    "with_langchain.py": (["--- astream ---", "tool calls: [('get_weather', {'city': 'Paris'})]"], True),
    "with_langgraph.py": (["graph answer:", "tool calls:"], False),
    "with_openai_agents.py": (["get_weather called with Paris", "final output:"], False),
    "with_pydantic_ai.py": (["City(name="], False),
    "with_instructor.py": (["City(name="], False),
    "with_smolagents.py": (["get_weather called with", "final answer:"], False),
}


def test_every_example_is_tested():
    assert sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py")) == sorted(EXPECTED)
    assert sorted(f for f in os.listdir(INTEGRATIONS) if f.endswith(".py")) == sorted(INTEGRATION_EXPECTED)


def _run(path: str, expected: list[str]) -> None:
    # The examples run as users run them: on a CPU with VNNI the quantized matmuls take int8 activations
    # (VX_CPU_MATMUL=auto), which can flip the default model's near-tied greedy choices; the expected lines are the
    # ones both paths print.
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    res = subprocess.run([sys.executable, path], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout + res.stderr
    for want in expected:
        assert want in out, f"{os.path.basename(path)}: {want!r} missing from its output:\n{out[-3000:]}"


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_example_runs(script, default_model_dir):
    _run(os.path.join(EXAMPLES, script), EXPECTED[script])


@pytest.mark.parametrize("script", sorted(INTEGRATION_EXPECTED))
def test_integration_example_runs(script, default_model_dir):
    expected, always = INTEGRATION_EXPECTED[script]
    if not always and os.environ.get("VX_EXAMPLES") != "1":
        pytest.skip("runs under `make examples`, which installs its framework")
    _run(os.path.join(INTEGRATIONS, script), expected)
