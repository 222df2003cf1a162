"""What every way of making a decode graph shares: the forward it captures and the `GraphCapture` interface.

`vx.gpu.graphs.decode_graphs.DecodeGraphs` decides which sizes exist and when they are built; a `GraphCapture`
builds the graph of one size from a call on the persistent buffers' views, and runs it again on the same views:
`InductorGraphs` (`inductor.py`, compiled in the engine), `AotiGraphs` (`aoti_loader.py`, the CPU's default:
compiled ahead of time in a child process and loaded without the compiler) or `CudaGraphs` (`cuda.py`).
"""

from __future__ import annotations

import types
from typing import Any, Callable, Protocol

import torch

Forward = Callable[..., torch.Tensor]


class CompileCancelled(RuntimeError):
    """A graph's build was stopped because its engine shuts down: nothing failed, so nothing to warn about."""


class GraphCapture(Protocol):
    """Builds and runs the graph of each padded batch size on the persistent buffers' views."""

    def build(self, size: int, args: tuple[Any, ...]) -> None:
        """Make the graph of `size` (args: the forward's arguments at that size)."""

    def run(self, size: int, args: tuple[Any, ...]) -> torch.Tensor:
        """The forward's output at `size`, through its graph (built before)."""


def decode_forward(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                   attn_metadata: Any) -> torch.Tensor:
    """What a graph computes: the model's forward on a decode batch (compiled once per size)."""
    return model(input_ids, positions, attn_metadata)


def own_copy(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """`fn` with a code object of its own: dynamo keeps compiled code per code object, and the graphs of two
    engines in one process (other models, other cache sizes) must never serve each other's calls, since their
    guards check the batch size only."""
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name)
