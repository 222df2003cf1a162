"""The C kernels of a test session, shared with tests that start from an empty `VX_CACHE_DIR`.

Such a test wants a fresh cache for what it checks (decode-graph packages, a GGUF file's config directory), not
fresh kernels: each kernel library is an -O3 compile of seconds, and a fresh cache would build all of them again.
"""

from __future__ import annotations

import os
from pathlib import Path

from vx import envs

SESSION_KERNELS = Path(envs.VX_CACHE_DIR.get()) / "kernels"
"""Where this session builds its kernels (read when the session starts, before any test points the cache elsewhere)."""


def share_kernels(cache_dir: str | os.PathLike) -> None:
    """Link `cache_dir/kernels` to the session's kernels (nothing if `cache_dir` has kernels of its own)."""
    link = Path(cache_dir) / "kernels"
    if link.exists() or link.is_symlink():
        return
    SESSION_KERNELS.mkdir(parents=True, exist_ok=True)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(SESSION_KERNELS, target_is_directory=True)


def share_kernels_except(cache_dir: str | os.PathLike, missing: set[str]) -> None:
    """Give `cache_dir/kernels` the session's kernels for a GGUF model (built there first if need be), all but the
    libraries whose source is named in `missing`: an engine started on it builds just those, as a first start
    would build all of them, in the time of the smallest compile."""
    from vx.gpu.attention import cpu_kernels
    from vx.kernels import gguf_matmul
    from vx.kernels.build import build_libraries

    build_libraries([*gguf_matmul.default_libraries(), cpu_kernels.LIBRARY])
    kernels = Path(cache_dir) / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    for library in SESSION_KERNELS.glob("*.so"):
        if library.name.rsplit("-", 1)[0] not in missing:
            (kernels / library.name).symlink_to(library)
