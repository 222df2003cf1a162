"""Compile a C kernel on first use with the machine's C compiler and load it through ctypes.

A kernel is built once per machine (`-O3 -march=native`, OpenMP) into `$VX_CACHE_DIR/kernels/`, named by its
source file and a hash of its source, flags, compiler and the CPU's flags, so that a shared cache never serves a
binary built for another CPU. Without a compiler, or when the build fails, `load_library` returns None and the
caller keeps its PyTorch path. `VX_CPU_KERNELS=0` turns every kernel off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from vx import envs
from vx.platform import cpu_flags

logger = logging.getLogger(__name__)

# Linked without the compile flags on purpose: with -ffast-math at link time gcc adds crtfastmath.o, whose
# constructor switches the whole process to flush-to-zero (subnormal floats become 0 in torch, numpy and
# everything else). A kernel that compiles with -ffast-math stays a compile-step choice.
LDFLAGS = ("-shared", "-fopenmp")


def load_library(source: Path, cflags: Sequence[str], libs: Sequence[str], what: str) -> ctypes.CDLL | None:
    """The library built from `source` with `cflags` (compile step) and `libs` (link step), built if needed.

    None when kernels are off (`VX_CPU_KERNELS=0`), no compiler is found, or the build or load fails; `what`
    names the kernel in the log line that says so.
    """
    if not envs.VX_CPU_KERNELS.get():
        return None
    path = build_library(source, cflags, libs, what)
    if path is None:
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        logger.warning("vx: could not load the %s (%s); using the PyTorch path.", what, e)
        return None


def build_library(source: Path, cflags: Sequence[str], libs: Sequence[str], what: str) -> Path | None:
    """The path of the shared library built from `source`, compiled now unless the cache already holds it."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("vx: no C compiler found; the %s is off (PyTorch path).", what)
        return None
    name = source.stem
    key = hashlib.sha256(source.read_bytes() + " ".join([compiler, *cflags, *LDFLAGS, *libs]).encode()
                         + _compiler_version(compiler) + " ".join(cpu_flags()).encode()).hexdigest()[:16]
    cache_dir = Path(envs.VX_CACHE_DIR.get()) / "kernels"
    target = cache_dir / f"{name}-{key}.so"
    if target.exists():
        return target
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        # Build beside the target, then rename: concurrent processes never load a half-written library.
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
            tmp_obj, tmp_lib = Path(tmp) / f"{name}.o", Path(tmp) / target.name
            subprocess.run([compiler, *cflags, "-c", str(source), "-o", str(tmp_obj)],
                           check=True, capture_output=True, timeout=120)
            subprocess.run([compiler, *LDFLAGS, str(tmp_obj), "-o", str(tmp_lib), *libs],
                           check=True, capture_output=True, timeout=120)
            os.replace(tmp_lib, target)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("vx: building the %s failed (%s %s); using the PyTorch path.", what, e,
                       detail.decode(errors="replace")[-500:])
        return None
    return target


def _compiler_version(compiler: str) -> bytes:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return b""
