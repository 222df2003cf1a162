"""Importing vx works on every OS: no vx module imports a POSIX-only module (fcntl, resource, termios, ...) when it
is imported; code that needs one imports it where it runs, with a fallback for the other systems."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

POSIX_ONLY = {"fcntl", "resource", "termios", "pwd", "grp", "tty", "pty", "syslog"}
ROOT = Path(__file__).resolve().parents[1] / "vx"

# Runs in a fresh interpreter where the POSIX-only modules cannot be imported at all, as on Windows. A vx module
# may still fail through a third-party package that imports its own platform backend (psutil's Linux one; on
# Windows it would import its Windows one): only a failure whose import statement is vx's own counts.
_IMPORT_EVERYTHING = textwrap.dedent("""
    import importlib, importlib.abc, importlib.util, os, pkgutil, sys, traceback

    BLOCKED = set(sys.argv[1].split(","))
    VX_DIR = os.path.dirname(importlib.util.find_spec("vx").origin) + os.sep

    class PosixOnlyBlocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (POSIX-only)", name=name)
            return None

    sys.meta_path.insert(0, PosixOnlyBlocker())
    for name in BLOCKED:
        sys.modules.pop(name, None)

    def importer(tb):
        # The file of the import statement that asked for the blocked module: the last frame outside importlib
        # (and the blocker).
        frames = [f for f in traceback.extract_tb(tb) if "importlib" not in f.filename and f.name != "find_spec"]
        return frames[-1].filename if frames else ""

    failed = []
    import vx
    modules = [f"vx.{name}" for name in vx.__all__] + [i.name for i in pkgutil.walk_packages(vx.__path__, "vx.")]
    for name in modules:
        try:
            getattr(vx, name[3:]) if name[3:] in vx.__all__ else importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name in BLOCKED and importer(e.__traceback__).startswith(VX_DIR):
                failed.append(f"{name}: {importer(e.__traceback__)} imports {e.name}")
    print("\\n".join(failed + [f"failed: {len(failed)}"]))
""")


def test_importing_vx_needs_no_posix_only_module():
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-c", _IMPORT_EVERYTHING, ",".join(sorted(POSIX_ONLY))],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.splitlines()[-1] == "failed: 0", res.stdout[-5000:]


def _import_time_imports(body: list[ast.stmt], guarded: bool = False):
    """(module name, line, guarded) of each import that runs when the module is imported: at module level and in
    class bodies, `if`, `with` and `try` blocks; not in functions. `guarded`: inside a `try` that catches
    ImportError (or a broader exception)."""
    for node in body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, guarded
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno, guarded
        elif isinstance(node, ast.Try):
            caught = {ast.unparse(h.type) if h.type is not None else "" for h in node.handlers}
            catches = bool(caught & {"ImportError", "ModuleNotFoundError", "Exception", "BaseException", ""}) or any(
                "ImportError" in c or "ModuleNotFoundError" in c for c in caught)
            yield from _import_time_imports(node.body, guarded or catches)
            for part in (*[h.body for h in node.handlers], node.orelse, node.finalbody):
                yield from _import_time_imports(part, guarded)
        elif isinstance(node, (ast.If, ast.With, ast.ClassDef)):
            yield from _import_time_imports(node.body, guarded)
            yield from _import_time_imports(getattr(node, "orelse", []), guarded)


def test_no_vx_module_imports_a_posix_only_module_at_import_time():
    """The static side of the test above: it also sees modules that a third-party failure kept from importing."""
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for module, line, guarded in _import_time_imports(tree.body):
            if module.split(".")[0] in POSIX_ONLY and not guarded:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {module}")
    assert not bad, "POSIX-only imports at import time (move them into the function that needs them): " + \
        "; ".join(bad)
