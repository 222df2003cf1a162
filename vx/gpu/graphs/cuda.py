"""CUDA graphs for decode: one `torch.cuda.CUDAGraph` per padded batch size, replayed on the persistent buffers.

A size is captured after an eager warm-up (Triton kernels compile and lazy state is created outside the capture),
all sizes sharing one memory pool; a run replays the graph, which reads the buffers where they are and writes the
same output tensor each time. Decode on a big GPU is bound by kernel launches without it: a replay launches the
step's hundreds of kernels in one call.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from vx.gpu.graphs.capture import Forward

# (forward, its arguments, memory pool) -> (replay, the output tensor every replay rewrites)
CaptureFn = Callable[[Forward, tuple[Any, ...], Any], tuple[Callable[[], Any], torch.Tensor]]


def cuda_capture(forward: Forward, args: tuple[Any, ...], pool: Any) -> tuple[Callable[[], Any], torch.Tensor]:
    """Capture `forward(*args)` into a CUDA graph in `pool`; (its replay, its output tensor)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = forward(*args)
    return graph.replay, output


class CudaGraphs:
    """CUDA: one captured graph per size, replayed on the persistent buffers; all sizes share a memory pool, so
    build the largest first (its activations then hold every smaller graph's)."""

    def __init__(self, forward: Forward, capture: CaptureFn | None = None, pool: Any = None,
                 synchronize: Callable[[], None] | None = None) -> None:
        self._forward = forward
        self._capture = capture or cuda_capture
        self._pool = pool if pool is not None or capture is not None else torch.cuda.graph_pool_handle()
        self._synchronize = synchronize or (torch.cuda.synchronize if capture is None else (lambda: None))
        self._graphs: dict[int, tuple[Callable[[], Any], torch.Tensor]] = {}

    def build(self, size: int, args: tuple[Any, ...]) -> None:
        # Eager warm-up first: kernels compile (Triton), lazy buffers are made, nothing of that inside the capture.
        self._forward(*args)
        self._synchronize()
        self._graphs[size] = self._capture(self._forward, args, self._pool)
        self._synchronize()

    def run(self, size: int, args: tuple[Any, ...]) -> torch.Tensor:
        replay, output = self._graphs[size]
        replay()
        return output
