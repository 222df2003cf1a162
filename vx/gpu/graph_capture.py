"""The two ways a decode graph is made and run: compiled with inductor (CPU) or captured as a CUDA graph (CUDA).

`vx.gpu.decode_graphs.DecodeGraphs` decides which sizes exist and when they are built; a `GraphCapture` builds the
graph of one size from a call on the persistent buffers' views, and runs it again on the same views.

- `InductorGraphs`: one `torch.compile`d function; a size is built by calling it at that size (dynamo compiles
  one entry per size), and run by calling it again.
- (`vx.gpu.aoti_graphs.AotiGraphs`, the CPU's default: the same graph AOT-compiled in a child process and loaded
  as a package, so the engine never imports the compiler.)
- `CudaGraphs`: one `torch.cuda.CUDAGraph` per size, captured after an eager warm-up (Triton kernels compile and
  lazy state is created outside the capture), all sizes sharing one memory pool; a run replays the graph, which
  reads the buffers where they are and writes the same output tensor each time. Decode on a big GPU is bound by
  kernel launches without it: a replay launches the step's hundreds of kernels in one call.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Protocol

import torch

Forward = Callable[..., torch.Tensor]
# (forward, its arguments, memory pool) -> (replay, the output tensor every replay rewrites)
CaptureFn = Callable[[Forward, tuple[Any, ...], Any], tuple[Callable[[], Any], torch.Tensor]]


class CompileCancelled(RuntimeError):
    """A graph's build was stopped because its engine shuts down: nothing failed, so nothing to warn about."""


class GraphCapture(Protocol):
    """Builds and runs the graph of each padded batch size on the persistent buffers' views."""

    def build(self, size: int, args: tuple[Any, ...]) -> None:
        """Make the graph of `size` (args: the forward's arguments at that size)."""

    def run(self, size: int, args: tuple[Any, ...]) -> torch.Tensor:
        """The forward's output at `size`, through its graph (built before)."""


def own_copy(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """`fn` with a code object of its own: dynamo keeps compiled code per code object, and the graphs of two
    engines in one process (other models, other cache sizes) must never serve each other's calls, since their
    guards check the batch size only."""
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name)


def _batch_size_guards_only(entries: list[Any]) -> list[bool]:
    """Guards the graphs keep: the token ids' shape, which tells the sizes apart, and nothing else.

    The model, its weights and the buffers are the same objects on every call, so the rest of dynamo's guards
    (hundreds: one per parameter) would cost ~3 ms a step to check and could never fail.
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
