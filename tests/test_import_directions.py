"""The import directions of ../shared/DESIGN.md, read from every module's source: a circle between modules, or an
import against the allowed direction, fails here before it can fail at run time."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "vx"

# package -> the packages (and third-party roots) it must never import, lazily or not.
FORBIDDEN = {
    "client": {"gpu", "models", "executor", "serve", "torch"},
    "cache": {"core", "gpu", "models", "client", "executor"},
    "gpu": {"core", "client", "executor", "cache"},
    "models": {"gpu", "core", "client", "executor"},
    "executor": {"client", "core", "cache"},
    # vx's C kernels and their build machinery: used by both models and gpu, so they import neither.
    "kernels": {"core", "gpu", "models", "client", "executor"},
    # process groups and collectives: the workers and the models' layers use them, so they import neither.
    "distributed": {"core", "gpu", "models", "client", "executor"},
}
# Modules anyone may import: they import none of the packages above.
LEAVES = ("config", "sampling_params", "pooling_params", "errors", "outputs", "envs", "platform", "progress",
          "step", "module_process", "class_path", "version", "optional_dependencies", "kv_spec")
# Leaves inside a package: what the application process reads beside the code it describes (DESIGN.md: a registry
# lives beside its code in a module that imports nothing heavy). Each is a unit of its own, and the package
# `__init__` files on its way count only for what they themselves import.
LEAF_MODULES = ("models.registry", "models.gguf.header", "models.layers.quantization.registry",
                "models.layers.quantization.tp_split", "gpu.attention.registry")
ON_NESTED_LEAVES_WAY = {"vx." + ".".join(m.split(".")[:i]) for m in LEAF_MODULES for i in range(1, len(m.split(".")))}
"""The packages whose __init__ files run when a leaf module inside a package is imported."""


def _unit(module: str) -> str:
    """The package (or top-level module) a dotted vx module belongs to: vx.core.scheduler -> core; a leaf module
    inside a package is its own unit: vx.models.registry -> models.registry."""
    rest = module.removeprefix("vx.")
    leaf = next((m for m in LEAF_MODULES if rest == m or rest.startswith(m + ".")), None)
    if leaf is not None:
        return leaf
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
    bad = [f"{leaf} imports {dst}" for leaf in LEAVES + LEAF_MODULES for dst in sorted(edges.get(leaf, ()))
           if dst in packages]
    assert not bad, "leaf modules must stay leaves: " + "; ".join(bad)


def test_packages_on_a_nested_leafs_way_import_nothing():
    """Importing a nested leaf runs its packages' __init__ files: they import no vx module and nothing heavy when
    imported (their names load on first use), so reading a registry reaches nothing else of its package."""
    allowed = {"__future__", "importlib", "typing", "vx.class_path"}
    bad = []
    for package in sorted(ON_NESTED_LEAVES_WAY):
        path = ROOT.parent.joinpath(*package.split("."), "__init__.py")
        for node in _at_import(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            bad += [f"{package} imports {n}" for n in names if n not in allowed and n.split(".")[0] not in allowed]
    assert not bad, "package __init__ files on a registry's way must be lazy: " + "; ".join(bad)


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


# ------------------------------------------------------------------------------------------- file by file
def _module_files() -> dict[str, Path]:
    """Dotted vx module name (a package by its name) -> its source file."""
    files = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        files[".".join(rel.parts).removesuffix(".__init__")] = path
    return files


def _at_import(tree: ast.AST):
    """The nodes that run when a module is imported: everything but function bodies (lazy imports)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(child for child in ast.iter_child_nodes(node)
                    if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))


def _file_imports(lazy: bool = True) -> dict[str, set[str]]:
    """vx module -> the vx modules it imports by name (`from vx.a import b` imports vx.a.b when that is a module,
    else vx.a): all of them, or (`lazy=False`) those imported when the module itself is."""
    files = _module_files()
    edges: dict[str, set[str]] = defaultdict(set)
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree) if lazy else _at_import(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                         for a in node.names]
            else:
                continue
            edges[module].update(n for n in names if n in files and n != module)
    return edges


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other in a circle (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def test_no_circle_between_files():
    """No module imports one that imports it back, however far round (within a package too: the executor's
    registry names its kinds, the abstract class does not import them)."""
    circles = _strongly_connected(_file_imports())
    assert not circles, "modules importing each other in a circle: " + "; ".join(" <-> ".join(c) for c in circles)


def _directly_imported(edges: dict[str, set[str]], modules: set[str]) -> set[str]:
    """The modules that one of `modules` imports by name (not merely as the package of what it imports)."""
    return {target for module in modules for target in edges.get(module, ())}


def test_no_forbidden_direction_through_other_packages():
    """Importing a package's modules loads no module of a package it must not import, through any chain of
    imports (importing a module runs its packages' `__init__` files too): a package reaches no forbidden package
    through a third (a leaf, say). Imports inside functions are the deliberate lazy paths (the in-process engine of
    `vx.LLM`), held by `test_no_forbidden_direction`."""
    edges = _file_imports(lazy=False)
    bad = []
    for src, banned in FORBIDDEN.items():
        todo = [m for m in edges if _unit(m) == src] + [m for m in _module_files() if _unit(m) == src]
        seen: set[str] = set()
        on_the_way: set[str] = set()  # package __init__ files run only to reach a leaf module inside them
        while todo:
            module = todo.pop()
            if module in seen:
                continue
            seen.add(module)
            todo.extend(edges.get(module, ()))
            parts = module.split(".")
            packages = [".".join(parts[:i]) for i in range(2, len(parts))]  # its packages' __init__ files
            if _unit(module) in LEAF_MODULES:
                on_the_way.update(p for p in packages if p not in seen)
            todo.extend(packages)
        reached = {_unit(m) for m in seen - (on_the_way - _directly_imported(edges, seen))} & banned
        bad += [f"{src} reaches {dst}" for dst in sorted(reached)]
    assert not bad, "imports against DESIGN.md's directions, through other modules: " + "; ".join(bad)
