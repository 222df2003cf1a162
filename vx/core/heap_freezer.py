"""Keeping the garbage collector's full passes short in the engine process.

A full (oldest-generation) collection walks every tracked object: after start-up (torch, the model, compiled
decode graphs) that is hundreds of thousands, and the walk pauses the step that triggers it for a large part of a
second. What exists when the engine starts serving lives as long as the process, so it is frozen out of the
collector's view (`gc.freeze`, as vLLM does after start-up); objects a background compile adds later are frozen
the next time the engine is idle, so the pass never runs inside a step.
"""

from __future__ import annotations

import gc

REFREEZE_GROWTH = 20_000
"""Objects in the oldest generation, beyond the frozen ones, that make an idle engine freeze again."""


class HeapFreezer:
    """Freezes the heap at start-up and, when idle, again after it has grown (a graph compiled meanwhile)."""

    def __init__(self, refreeze_growth: int = REFREEZE_GROWTH) -> None:
        self.refreeze_growth = refreeze_growth

    def freeze(self) -> None:
        """Collect what is garbage now, then freeze every survivor out of later passes."""
        gc.collect()
        gc.freeze()

    def freeze_if_grown(self) -> bool:
        """Freeze again when the oldest generation has grown past `refreeze_growth` objects; True if it did."""
        if len(gc.get_objects(generation=2)) < self.refreeze_growth:
            return False
        self.freeze()
        return True
