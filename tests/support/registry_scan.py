"""The collection literals of vx's source that list a registry's names: a tuple, list, set or dict (its keys) with
two or more of them, or of nothing else, is a second list of the registry's names, which the next row added would
not be in."""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterator
from pathlib import Path

VX = Path(__file__).resolve().parents[2] / "vx"


def _collections(tree: ast.AST) -> Iterator[tuple[int, list[ast.expr]]]:
    """(line, elements) of every tuple, list and set literal, and every dict literal's keys."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            yield node.lineno, node.elts
        elif isinstance(node, ast.Dict):
            yield node.lineno, [k for k in node.keys if k is not None]


def name_lists(names: Collection[str], skip: Collection[str] = (),
               allowed: Collection[tuple[str, frozenset[str]]] = ()) -> list[str]:
    """"file:line: names" of each collection literal in vx/**/*.py holding two or more of `names`, or only names
    of `names`, but in the files
    `skip` (paths relative to vx/'s parent, e.g. "vx/gpu/attention/registry.py") and the (file, names) pairs
    `allowed` (a literal whose strings only coincide with the names)."""
    found = []
    for path in sorted(VX.rglob("*.py")):
        rel = path.relative_to(VX.parent).as_posix()
        if rel in skip:
            continue
        for line, elements in _collections(ast.parse(path.read_text(), rel)):
            strings = [e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            hit = frozenset(s for s in strings if s in names)
            only_names = bool(hit) and len(strings) == len(elements) == len([s for s in strings if s in names])
            if (len(hit) >= 2 or only_names) and (rel, hit) not in allowed:
                found.append(f"{rel}:{line}: {', '.join(sorted(hit))}")
    return found
