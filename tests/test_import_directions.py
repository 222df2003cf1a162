"""The import directions of ../shared/DESIGN.md, read from every module's source: a cycle between packages, or an
import against the allowed direction, fails here before it can fail at run time."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "vx"

# package -> the packages (and third-party roots) it must never import, lazily or not.
FORBIDDEN = {
    "client": {"gpu", "models", "executor", "torch"},
    "cache": {"core", "gpu", "models", "client", "executor"},
    "gpu": {"core", "client", "executor"},
    "models": {"gpu", "core", "client", "executor"},
    "executor": {"client", "core"},
    # vx's C kernels and their build machinery: used by both models and gpu, so they import neither.
    "kernels": {"core", "gpu", "models", "client", "executor"},
    # process groups and collectives: the workers and the models' layers use them, so they import neither.
    "distributed": {"core", "gpu", "models", "client", "executor"},
}
# Modules anyone may import: they import none of the packages above.
LEAVES = ("config", "sampling_params", "pooling_params", "errors", "outputs", "envs", "platform", "attention_backends",
          "model_architectures", "step", "module_process", "cpu_defaults", "class_path", "version", "model_limits",
          "checkpoint_files", "gguf_header")


def _unit(module: str) -> str:
    """The package (or top-level module) a dotted vx module belongs to: vx.core.scheduler -> core."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _imports() -> dict[str, set[str]]:
    """vx module unit -> the units it imports (vx units by name, third-party by their root)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        unit = _unit(module)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from vx import envs` imports the module vx.envs
                names = [f"vx.{a.name}" for a in node.names] if node.module == "vx" else [node.module]
            else:
                continue
            for name in names:
                if name == "vx" or name.startswith("vx."):
                    target = _unit(name) if "." in name else "vx"
                    if target != unit:
                        edges[unit].add(target)
                else:
                    edges[unit].add("ext:" + name.split(".")[0])
    return edges




def test_no_forbidden_direction():
    edges = _imports()
    bad = {f"{src} imports {dst.removeprefix('ext:')}" for src, banned in FORBIDDEN.items()
           for dst in sorted(edges.get(src, ())) if dst.removeprefix("ext:") in banned}
    assert not bad, "imports against DESIGN.md's directions: " + "; ".join(sorted(bad))


def test_leaves_import_no_package():
    edges = _imports()
    packages = {"client", "core", "cache", "gpu", "models", "executor", "serve", "distributed", "cli", "kernels"}
    bad = [f"{leaf} imports {dst}" for leaf in LEAVES for dst in sorted(edges.get(leaf, ())) if dst in packages]
    assert not bad, "leaf modules must stay leaves: " + "; ".join(bad)


def _cycles(edges: dict[str, set[str]]) -> set[str]:
    """Every elementary cycle between units, each written from its smallest unit (a -> b -> a)."""
    found: set[str] = set()

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(edges.get(node, ())):
            if nxt == start:
                found.add(" -> ".join(path + [start]))
            elif nxt not in path and nxt > start:
                walk(start, nxt, path + [nxt])

    for start in sorted(edges):
        walk(start, start, [start])
    return found


def test_no_cycle_between_packages():
    edges = {src: {d for d in dsts if not d.startswith("ext:")} for src, dsts in _imports().items()}
    assert not _cycles(edges)
