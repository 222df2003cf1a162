"""The lines that tell a user why a start takes longer than usual: vx building what it caches on first use (its C
kernels for this CPU, a model's decode graph), with an estimate and a line when it is done.

They are log records of one logger, `vx.progress`, at INFO. vx's own processes (the engine process, the workers
of a split model) show them on the stderr they share with the application, the same way the engine's warnings
reach it (`show_progress`); `VX_PROGRESS=0` keeps them quiet. In the application's own process (the in-process
engine of `vx.LLM`) they are the application's to show, as any library's records: they propagate to its logging.
A start that finds everything cached logs none of them.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from vx import envs

LOGGER_NAME = "vx.progress"
logger = logging.getLogger(LOGGER_NAME)


def show_progress(stream: TextIO | None = None) -> None:
    """Show the progress lines on `stream` (default: stderr) in this process, once; nothing with `VX_PROGRESS=0`.

    Only for vx's own processes, whose logging is vx's to set up; the records stop here (no duplicate through a
    root handler that something else may add).
    """
    if not envs.VX_PROGRESS.get() or any(getattr(h, "vx_progress", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.vx_progress = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
