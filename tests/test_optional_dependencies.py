"""A feature behind an extra, used without it installed, fails with an error that says what to pip install."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vx.optional_dependencies import MissingExtraError, needs_extra

ROOT = Path(__file__).resolve().parents[1]


def _run_without_fastapi(code: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter where importing fastapi fails as if it were not installed."""
    prelude = "import sys\nsys.modules['fastapi'] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_openai_client_without_fastapi_names_the_serve_extra():
    proc = _run_without_fastapi(
        "import vx\n"
        "from vx.optional_dependencies import MissingExtraError\n"
        "try:\n"
        "    vx.openai_client\n"
        "except MissingExtraError as e:\n"
        "    assert isinstance(e, ModuleNotFoundError) and e.name == 'fastapi', repr(e)\n"
        "    print(e)\n"
        "else:\n"
        "    raise SystemExit('no error')\n")
    assert proc.returncode == 0, proc.stderr
    assert "vx.openai_client needs the `serve` extra (missing: fastapi): pip install 'vx[serve]'" in proc.stdout


def test_vx_serve_without_fastapi_names_the_serve_extra():
    proc = _run_without_fastapi("from vx.cli import main\nmain(['serve'])\n")
    assert proc.returncode == 1
    assert "vx serve needs the `serve` extra (missing: fastapi): pip install 'vx[serve]'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_missing_third_party_module_becomes_the_extras_error():
    with pytest.raises(MissingExtraError, match=r"feature needs the `serve` extra \(missing: no_such_pkg\)") as info:
        with needs_extra("feature", "serve"):
            import no_such_pkg  # noqa: F401
    assert isinstance(info.value, ModuleNotFoundError) and info.value.name == "no_such_pkg"


def test_a_missing_module_of_vx_itself_is_left_as_it_is():
    """A vx module that does not import is a broken install or a bug: no extra would fix it."""
    with pytest.raises(ModuleNotFoundError) as info:
        with needs_extra("feature", "serve"):
            import vx.no_such_module  # noqa: F401
    assert not isinstance(info.value, MissingExtraError)


def test_other_import_errors_pass_through():
    with pytest.raises(ImportError) as info:
        with needs_extra("feature", "serve"):
            raise ImportError("cannot import name 'x' from 'y'")
    assert not isinstance(info.value, MissingExtraError)
