"""vx/envs.py: each VX_* variable declared once, read when asked, and documented exactly as declared."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from vx import envs

REPO = Path(__file__).resolve().parents[1]


def _declared() -> dict[str, envs.EnvVar]:
    return {name: v for name, v in vars(envs).items() if isinstance(v, envs.EnvVar)}


def test_each_declaration_is_named_as_its_variable():
    declared = _declared()
    assert declared and all(var.name == attr and attr.startswith("VX_") for attr, var in declared.items())


def test_the_documented_table_is_the_declared_one():
    text = (REPO / "docs" / "configuration.md").read_text()
    section = text.split("## Environment", 1)[1]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| `VX_")]
    documented = {row[0].strip("`"): (row[1], row[2]) for row in rows}
    expected = {v.name: (f"`{v.default}`" if v.default else "none", v.meaning) for v in _declared().values()}
    assert documented == expected


def test_no_module_but_envs_names_a_vx_variable():
    found = set()
    for path in sorted((REPO / "vx").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel == "vx/envs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"VX_[A-Z0-9_]+", node.value):
                found.add((rel, node.value))
    assert found == set()


def test_values_are_read_at_each_call(monkeypatch, tmp_path):
    monkeypatch.delenv("VX_CACHE_DIR", raising=False)
    assert envs.VX_CACHE_DIR.get() == os.path.expanduser("~/.cache/vx")
    monkeypatch.setenv("VX_CACHE_DIR", str(tmp_path / "c"))
    assert envs.VX_CACHE_DIR.get() == str(tmp_path / "c")
    monkeypatch.setenv("VX_CACHE_DIR", "")
    assert envs.VX_CACHE_DIR.get() == os.path.expanduser("~/.cache/vx")


@pytest.mark.parametrize("raw,on", [(None, True), ("", True), ("1", True), ("0", False)])
def test_cpu_kernels_switch(monkeypatch, raw, on):
    if raw is None:
        monkeypatch.delenv("VX_CPU_KERNELS", raising=False)
    else:
        monkeypatch.setenv("VX_CPU_KERNELS", raw)
    assert envs.VX_CPU_KERNELS.get() is on


def test_api_key(monkeypatch):
    monkeypatch.delenv("VX_API_KEY", raising=False)
    assert envs.VX_API_KEY.get() is None
    monkeypatch.setenv("VX_API_KEY", "s3cret")
    assert envs.VX_API_KEY.get() == "s3cret"
