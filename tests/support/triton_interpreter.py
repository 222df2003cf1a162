"""Triton kernels checked on the CPU: a test module's checks run in ONE child process started with
TRITON_INTERPRET=1 (the interpreter replaces compiled kernels process-wide, so the child keeps it contained and pays
its import once), and report their results as one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]


def report(checks: dict[str, Callable[[], Any]]) -> None:
    """In the child: run every check (a failing one reports its traceback, the others still run) and print the
    results as one JSON line."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    results: dict[str, Any] = {}
    for name, check in checks.items():
        try:
            results[name] = check()
        except Exception:  # report, and keep checking the other cases
            results[name] = traceback.format_exc(limit=4)
    print(json.dumps(results))


def interpreter_results(module: str) -> dict[str, Any]:
    """In the test process: `python -m module --interpret-worker` under the interpreter; name -> its result."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", module, "--interpret-worker"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
