"""Decode graphs compiled by inductor in the engine's process: `VX_DECODE_GRAPHS=inductor`, and the fallback of
the AOT-compiled ones.

One `torch.compile`d function; a size is built by calling it at that size (dynamo compiles one entry per size),
and run by calling it again. The small ops of a layer fuse into a few loops, and the per-op Python and dispatch
cost goes (docs/decode_graphs.md).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from vx.gpu.graphs.capture import Forward


def _batch_size_guards_only(entries: list[Any]) -> list[bool]:
    """Guards the graphs keep: the token ids' shape, which tells the sizes apart, and nothing else.

    The model, its weights and the buffers are the same objects on every call, so the rest of dynamo's guards
    (hundreds: one per parameter) would cost milliseconds a step to check and could never fail.
    """
    return [entry.name == "input_ids" and entry.guard_type == "TENSOR_MATCH" for entry in entries]


def inductor(fn: Forward) -> Forward:
    """`fn` compiled by inductor, one graph per input shape, without per-call guards or asserts it cannot fail."""
    # No size or alignment asserts: the buffers are the graph's own, fixed at allocation, and each assert is a
    # Python call per layer and step.
    return torch.compile(fn, fullgraph=True, dynamic=False, options={
        "guard_filter_fn": _batch_size_guards_only, "size_asserts": False, "alignment_asserts": False})


class InductorGraphs:
    """CPU: one inductor-compiled forward; calling it at a size compiles that size once."""

    def __init__(self, forward: Forward, num_sizes: int, compile_fn: Callable[[Forward], Forward] | None = None,
                 ) -> None:
        self._compiled = (compile_fn or inductor)(forward)
        self._num_sizes = num_sizes

    def build(self, size: int, args: tuple[Any, ...]) -> None:
        # A recompile per size is the design: each size adds one entry to the compiled function's cache.
        with torch._dynamo.config.patch(recompile_limit=self._num_sizes + 1):
            self._compiled(*args)

    def run(self, size: int, args: tuple[Any, ...]) -> torch.Tensor:
        return self._compiled(*args)
