"""Every script in examples/ runs to its end on the default model, on CPU, and shows what it promises."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")

# script -> lines its output must contain
EXPECTED = {
    "demo.py": ["Paris"],
    "stream.py": ["--- chat ---"],
    "concurrent_streams.py": ["cancelled: [3, 7, 11, 15]", "running=0 waiting=0 kv_blocks_in_use=0"],
    "agent_loop.py": ["tool: calculator(", "short-timeout turn: [timed out]", "running=0 kv_blocks_in_use=0"],
    "offline_batch.py": ["16 requests", "num_running=0, num_waiting=0", "kv_blocks_in_use=0"],
}


def test_every_example_is_tested():
    assert sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py")) == sorted(EXPECTED)


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_example_runs(script, default_model_dir):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    res = subprocess.run([sys.executable, os.path.join(EXAMPLES, script)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout + res.stderr
    for want in EXPECTED[script]:
        assert want in out, f"{script}: {want!r} missing from its output:\n{out[-3000:]}"
