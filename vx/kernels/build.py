"""Compile a C kernel on first use with the machine's C compiler and load it through ctypes.

A kernel is built once per machine (`-O3 -march=native`, OpenMP) into `$VX_CACHE_DIR/kernels/`, named by its
source file and a hash of its source, flags, compiler and the CPU's flags, so that a shared cache never serves a
binary built for another CPU. Without a compiler, or when the build fails, `load_library` returns None and the
caller keeps its PyTorch path. `VX_CPU_KERNELS=0` turns every kernel off.

A worker builds the libraries its model may use together before the model loads (`build_libraries`: in parallel,
with a progress line when any is missing, since a first start otherwise waits on them in silence); the loads that
follow find them built. A library is built under a lock file beside it, so that threads and processes that want
the same one (workers of one machine, the decode graphs' compile child) wait for one build instead of each
building it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from vx import envs, progress
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


@dataclass(frozen=True)
class Library:
    """One kernel library as its loader builds it: the source, the compile step's flags, the link step's libraries,
    and what it is called in log lines."""

    source: Path
    cflags: tuple[str, ...]
    libs: tuple[str, ...]
    what: str


def build_libraries(libraries: Sequence[Library]) -> None:
    """Build those of `libraries` the cache lacks, in parallel (one compiler per core), saying so on the progress
    log when any is missing; a failed build is logged and left to its loader's PyTorch path."""
    if not envs.VX_CPU_KERNELS.get():
        return
    missing = [lib for lib in dict.fromkeys(libraries)
               if (path := library_path(lib)) is not None and not path.exists()]
    if not missing:
        return
    progress.logger.info("vx: building vx's CPU kernels for this machine (first run only: %d C %s)",
                         len(missing), "library" if len(missing) == 1 else "libraries")
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, min(len(missing), os.cpu_count() or 1)),
                            thread_name_prefix="vx-kernel-build") as pool:
        built = list(pool.map(lambda lib: build_library(lib.source, lib.cflags, lib.libs, lib.what), missing))
    progress.logger.info("vx: CPU kernels built in %.1f s (%d of %d; cached in %s)", time.perf_counter() - start,
                         sum(path is not None for path in built), len(missing), _cache_dir())


def library_path(library: Library) -> Path | None:
    """Where the cache keeps `library` built for this CPU and compiler; None without a C compiler."""
    compiler = _compiler()
    return None if compiler is None else _target(compiler, library.source, library.cflags, library.libs)


def build_library(source: Path, cflags: Sequence[str], libs: Sequence[str], what: str) -> Path | None:
    """The path of the shared library built from `source`, compiled now unless the cache already holds it."""
    compiler = _compiler()
    if compiler is None:
        logger.info("vx: no C compiler found; the %s is off (PyTorch path).", what)
        return None
    target = _target(compiler, source, cflags, libs)
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _locked(target.with_suffix(".lock")):  # whoever holds it builds; the others find the library built
            if not target.exists():
                _compile(compiler, source, cflags, libs, target)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("vx: building the %s failed (%s %s); using the PyTorch path.", what, e,
                       detail.decode(errors="replace")[-500:])
        return None
    return target


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (threads and processes alike); no lock where the OS has no flock (each
    builder then builds, and the rename still keeps every library whole)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _compile(compiler: str, source: Path, cflags: Sequence[str], libs: Sequence[str], target: Path) -> None:
    # Build beside the target, then rename: a process that does not take the lock never loads a half-written one.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_obj, tmp_lib = Path(tmp) / f"{source.stem}.o", Path(tmp) / target.name
        subprocess.run([compiler, *cflags, "-c", str(source), "-o", str(tmp_obj)],
                       check=True, capture_output=True, timeout=120)
        subprocess.run([compiler, *LDFLAGS, str(tmp_obj), "-o", str(tmp_lib), *libs],
                       check=True, capture_output=True, timeout=120)
        os.replace(tmp_lib, target)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cache_dir() -> Path:
    return Path(envs.VX_CACHE_DIR.get()) / "kernels"


def _target(compiler: str, source: Path, cflags: Sequence[str], libs: Sequence[str]) -> Path:
    """The library's path in the cache: its source's name and a hash of everything the binary depends on."""
    key = hashlib.sha256(source.read_bytes() + " ".join([compiler, *cflags, *LDFLAGS, *libs]).encode()
                         + _compiler_version(compiler) + " ".join(cpu_flags()).encode()).hexdigest()[:16]
    return _cache_dir() / f"{source.stem}-{key}.so"


@functools.cache
def _compiler_version(compiler: str) -> bytes:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return b""
