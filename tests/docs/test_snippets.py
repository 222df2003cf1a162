"""Every ```python block of the README and docs/*.md runs as a script, as written.

A reader copies a block into a file and runs it, so each block is a whole program: its imports, and async code under
`anyio.run(main)` (top-level `await` is a SyntaxError in a script). Two HTML comments, on the line right before a
block, mark the ones that cannot run here:
- `<!-- no-run: reason -->`: a program that needs what this machine lacks (a GPU, a network, a server on a port, a
  model of your own); it must still compile as a script, and the test skips running it with that reason;
- `<!-- covered-by: where -->`: a program that runs here as written, but whose calls `where` already makes; the
  suite has ~40 s for the docs (each engine start costs seconds), so it compiles the block and skips running it;
- `<!-- signature -->`: a call signature, not a program; neither compiled nor run.
Each block runs in its own interpreter, on this checkout's `vx`, with no background compile (tests/conftest.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 120  # one block; a block normally takes a few seconds (an engine start and a handful of tokens)
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_MARKER = re.compile(r"<!--\s*(no-run|covered-by|signature)\s*:?\s*(.*?)\s*-->\s*\Z", re.S)


@dataclass(frozen=True)
class Snippet:
    """One ```python block: where it is, its code, and its marker (`no-run`, `covered-by`, `signature` or None) with reason."""

    path: Path
    line: int
    code: str
    marker: str | None
    reason: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def snippets(path: Path) -> list[Snippet]:
    """The ```python blocks of one Markdown file, each with the marker on the line before it, if any."""
    text = path.read_text()
    found = []
    for m in _BLOCK.finditer(text):
        before = text[:m.start()]
        previous_line = before.rstrip("\n").rsplit("\n", 1)[-1]
        marker = _MARKER.search(previous_line)
        found.append(Snippet(path, before.count("\n") + 1, m.group(1), marker and marker.group(1),
                             marker.group(2) if marker else ""))
    return found


ALL = [s for path in DOCS for s in snippets(path)]


def test_the_docs_have_runnable_snippets():
    """The scan finds blocks, and most of them run (a broken pattern would skip everything quietly)."""
    assert len(ALL) >= 20
    assert sum(s.marker is None for s in ALL) >= 6


@pytest.mark.parametrize("snippet", ALL, ids=lambda s: s.name)
def test_snippet_runs_as_a_script(snippet: Snippet, tmp_path):
    if snippet.marker == "signature":
        pytest.skip("a signature, not a program")
    compile(snippet.code, snippet.name, "exec")  # a script: no top-level await, no half statements
    if snippet.marker == "no-run":
        pytest.skip(snippet.reason)
    if snippet.marker == "covered-by":
        pytest.skip(f"runs as written; covered by {snippet.reason} (the suite's time budget)")
    script = tmp_path / "snippet.py"
    script.write_text(snippet.code)
    # A script's own folder comes first on sys.path, not the working directory: PYTHONPATH makes `vx` (and the
    # `tests.support` helpers docs/architecture.md imports) this checkout's.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VX_DECODE_COMPILE": "off", "OMP_WAIT_POLICY": "PASSIVE",
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{snippet.name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
