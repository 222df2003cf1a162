"""Decode graphs: a decode-only step runs a graph made for its padded batch size (CUDA graphs, and the CPU's analogue).

A decode step's shapes depend only on its number of requests, so each batch size in `capture_sizes` gets one
graph, built once: on the CPU compiled (the ~100 small ops of a layer fuse into a few loops and the per-op Python
and dispatch cost goes), on CUDA captured (one launch replays the step's kernels). A step of n requests runs the
smallest graph of at least n rows, on padding rows past n (`vx.gpu.graphs.buffers`). Attention inputs reach the
graph as `DecodeGraphMetadata`, tensors only, so a graph never depends on a step's Python numbers.

How a size's graph is made is the capture's (`vx.gpu.graphs.build` chooses it). On the CPU compiling a graph takes
tens of seconds, so it happens in the background, one size at a time, while eager steps serve (start-up and first
token are not delayed): size 1 at start-up (one stream is the first thing an embedded engine meets), every other
size the first time a step needs it. A queued size waits until the engine is idle (no step for
`IDLE_BEFORE_COMPILE_S`): a compile is mostly Python and holds the GIL, and one beside busy steps slows them for its
whole duration. `VX_DECODE_COMPILE=startup` builds every size before the engine serves (tests and benchmarks that
need the graphs from the first step). On CUDA a capture takes milliseconds and must not overlap eager work, so every
size is captured at start-up, largest first. `enforce_eager=True` builds none. The measurements behind these
choices: docs/decode_graphs.md.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from vx.gpu.graphs.buffers import DecodeBuffers, bucket_for, capture_sizes
from vx.gpu.graphs.capture import CompileCancelled, GraphCapture
from vx.gpu.graphs.compiler import CompilerThread

logger = logging.getLogger(__name__)

IDLE_BEFORE_COMPILE_S = 0.5  # a queued size compiles once no step has run for this long


def _stop_compiler(compiler: CompilerThread, cancel: Callable[[], None] | None, wait: bool = True) -> None:
    """Stop `compiler`, first killing a compile that runs in a child process (`cancel`, when the capture has one)."""
    if cancel is not None:
        cancel()
    compiler.stop(wait)


class DecodeGraphs:
    """The compiled decode graphs of one model runner: which sizes exist, compiling them, running a step."""

    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 capture: GraphCapture, num_kv_cache_groups: int = 1) -> None:
        """`capture`: how a size's graph is built (`vx.gpu.graphs.build.build_decode_graphs` chooses it)."""
        self.model = model
        self.device = device
        self.sizes = capture_sizes(max_num_seqs, device.type)
        self.buffers = DecodeBuffers.allocate(self.sizes[-1], max_blocks_per_seq, device, num_kv_cache_groups)
        self._capture = capture
        self._ready: set[int] = set()
        self._queued: set[int] = set()
        self._failed: dict[int, str] = {}
        self._lock = threading.Lock()
        self._stepping = False
        self._last_step = 0.0  # time.monotonic() when the last step ended
        graphs = weakref.ref(self)  # the compiler must not hold these graphs (and the model) alive
        self._compiler = CompilerThread(lambda: (g := graphs()) is None or g.idle())
        # Runs at interpreter exit too, if nobody shut the engine down; a compile in a child process is killed
        # rather than waited for (`AotiGraphs.cancel`, which holds no reference to the model).
        weakref.finalize(self, _stop_compiler, self._compiler, getattr(capture, "cancel", None))
        self.compile_seconds: dict[int, float] = {}
        self.steps_run: dict[int, int] = {}  # size -> decode steps it served

    # -- compiling ---------------------------------------------------------------------------------------------

    @contextmanager
    def step(self) -> Iterator[None]:
        """Wrap every step the engine runs (eager ones too): queued sizes compile only between them, once idle."""
        self._stepping = True
        try:
            yield
        finally:
            self._stepping = False
            self._last_step = time.monotonic()

    def idle(self) -> bool:
        """Whether no step runs and none has for `IDLE_BEFORE_COMPILE_S`."""
        return not self._stepping and time.monotonic() - self._last_step >= IDLE_BEFORE_COMPILE_S

    def compile_now(self, sizes: list[int] | None = None) -> None:
        """Build `sizes` (default: all) in this thread before returning, largest first (CUDA graphs share one
        memory pool, sized by the largest)."""
        for size in sorted(sizes if sizes is not None else self.sizes, reverse=True):
            self._compile(size)

    def compile_in_background(self, size: int) -> None:
        """Queue `size` for the background compiler, which builds it once the engine is idle; returns at once."""
        if self._compiler.stopped:
            return
        with self._lock:
            if size in self._queued or size in self._ready or size in self._failed:
                return
            self._queued.add(size)
        self._compiler.submit(size, self._compile)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every queued size is compiled (or failed); whether that happened within `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if self._queued <= self._ready | set(self._failed):
                    return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def shutdown(self, wait: bool = False) -> None:
        """Stop the background compiler: queued sizes are dropped; with `wait`, the one being compiled is waited for.

        A compile cannot be interrupted, and an interpreter that exits in the middle of one aborts ("terminate
        called without an active exception", from the compiler's C++ threads): so the exit itself waits for it
        (a finalizer registered with the thread). An engine process ends with os._exit, which needs no wait.
        """
        _stop_compiler(self._compiler, getattr(self._capture, "cancel", None), wait)

    def _compile(self, size: int) -> None:
        """Compile the graph of `size` by running it once on padding rows only (they touch the null block alone)."""
        if size in self._ready:
            return
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                self._capture.build(size, self._args(size))
        except CompileCancelled:  # the engine shuts down: nothing failed
            logger.debug("vx: compiling the decode graph of batch size %d stopped: the engine shuts down", size)
            return
        except Exception as e:  # noqa: BLE001 - that size stays eager, the engine goes on
            logger.warning("vx: compiling the decode graph of batch size %d failed (%s: %s); that size runs "
                           "eagerly", size, type(e).__name__, e)
            with self._lock:
                self._failed[size] = f"{type(e).__name__}: {e}"
                self._queued.add(size)
            return
        seconds = time.perf_counter() - start
        with self._lock:
            self.compile_seconds[size] = seconds
            self._ready.add(size)
            self._queued.add(size)
        logger.info("vx: decode graph for batch size %d compiled in %.1f s", size, seconds)

    def _args(self, size: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, Any]:
        b = self.buffers
        return self.model, b.input_ids[:size], b.positions[:size], b.metadata(size)

    # -- running -----------------------------------------------------------------------------------------------

    @property
    def ready_sizes(self) -> list[int]:
        with self._lock:
            return sorted(self._ready)

    def graph_size(self, num_reqs: int) -> int | None:
        """The compiled size that serves a decode step of `num_reqs` requests, or None (run it eagerly).

        The first time a size is needed it is queued for compiling, and the step runs eagerly meanwhile.
        """
        size = bucket_for(self.sizes, num_reqs)
        if size is None:
            return None
        if size not in self._ready:
            self.compile_in_background(size)
            return None
        return size

    def run(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, slot_mappings: Sequence[torch.Tensor],
            block_tables: Sequence[torch.Tensor], seq_lens: torch.Tensor) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode step of n requests through the graph of `size` (>= n); a slot
        mapping and a block table per KV-cache group."""
        n = input_ids.shape[0]
        self.buffers.fill(input_ids, positions, slot_mappings, block_tables, seq_lens, size)
        self.steps_run[size] = self.steps_run.get(size, 0) + 1
        return self._capture.run(size, self._args(size))[:n]
