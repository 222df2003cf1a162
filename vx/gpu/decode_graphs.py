"""Decode graphs: a decode-only step runs a graph made for its padded batch size (CUDA graphs, and the CPU's analogue).

A decode step's shapes depend only on its number of requests, so each batch size in `capture_sizes` gets one
graph, compiled once with torch.compile (inductor): the ~100 small ops of a layer fuse into a few loops and
the per-op Python and dispatch cost goes (measured on the default model at batch 1: 23 -> 14 ms a forward, AVX2
EPYC, 2 cores). A step of n requests runs the smallest graph of at least n rows; the rows past n are padding:
token 0 at position 0, writing its k/v into the null block's first slot (block 0 is never handed out) and
attending to that one slot, and their hidden states are cut off before the LM head, so they never sample.

Inputs live in persistent buffers (`DecodeBuffers`): a step copies its rows in and calls the graph on views of
them, which is what a CUDA graph needs and costs the CPU nothing. Attention inputs reach the graph as
`DecodeGraphMetadata`, tensors only, so a graph never depends on a step's Python numbers.

How a size's graph is made is the capture's: on the CPU AOT-compiled by AOTInductor in a child process and loaded
without the compiler (`vx.gpu.aoti_graphs`, the default: the engine's RSS stays ~200 MiB lower), or compiled by
inductor in the engine (`vx.gpu.graph_capture`, `VX_DECODE_GRAPHS=inductor` and the fallback); captured as a CUDA
graph on CUDA. On the CPU, compiling a graph takes 10-45 s on 2 cores (less when inductor's on-disk cache has it), so it
happens in the background, one size at a time, while eager steps serve (start-up and first token are not
delayed): size 1 at start-up (one stream is the first thing an embedded engine meets), every other size the first
time a step needs it. A queued size waits until the engine is idle (no step for `IDLE_BEFORE_COMPILE_S`): a
compile is mostly Python and holds the GIL, and one run beside busy steps cut them by a quarter for its duration
(32 x 128 tokens: 475 tok/s while size 16 compiled, 639 with every size compiled first, 587 all eager). `VX_DECODE_COMPILE=startup` builds every size before the engine serves (tests and
benchmarks that need the graphs from the first step). On CUDA a capture takes milliseconds and must not overlap
eager work, so every size is captured at start-up, largest first. `enforce_eager=True` builds none.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from vx.gpu.attention.backend import DecodeGraphMetadata
from vx.gpu.graph_capture import CompileCancelled, CudaGraphs, GraphCapture, InductorGraphs, own_copy

logger = logging.getLogger(__name__)

# The interpreter's GIL switch interval while a graph compiles in the background (default 5 ms).
_COMPILE_SWITCH_INTERVAL_S = 1e-4

PADDING_SLOT = 0  # the null block's first slot: padding rows write there and attend to it alone

IDLE_BEFORE_COMPILE_S = 0.5  # a queued size compiles once no step has run for this long
_IDLE_POLL_S = 0.05


def capture_sizes(max_num_seqs: int, device_type: str) -> list[int]:
    """The padded batch sizes that get a graph, ascending, the last one covering `max_num_seqs`.

    CUDA: 1, 2, 4, then steps of 8 (vLLM's choice; a graph is cheap to capture). CPU: powers of two, since each
    size costs a compile of tens of seconds and a padded row costs a CPU little (decode matmuls are bound by
    reading the weights, not by rows).
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}.")
    if device_type == "cuda":
        sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    else:
        sizes = [1 << i for i in range(max_num_seqs.bit_length()) if (1 << i) < max_num_seqs]
    return sizes + [max_num_seqs]


def bucket_for(sizes: list[int], num_reqs: int) -> int | None:
    """The smallest size holding `num_reqs` rows, or None when none does."""
    for size in sizes:
        if size >= num_reqs:
            return size
    return None


@dataclass
class DecodeBuffers:
    """The graphs' inputs, allocated once for the largest size; a graph of size b reads the first b rows. A model
    whose layers use several KV-cache groups (one per attention kind) has a slot mapping and a block table per
    group; `slot_mapping` and `block_table` are the first group's."""

    input_ids: torch.Tensor    # int64 [max]
    positions: torch.Tensor    # int64 [max]
    slot_mappings: list[torch.Tensor]  # int64 [max], one per group
    block_tables: list[torch.Tensor]  # int32 [max, max_blocks_per_seq], one per group
    seq_lens: torch.Tensor     # int32 [max]

    @classmethod
    def allocate(cls, max_size: int, max_blocks_per_seq: int, device: torch.device, num_groups: int = 1,
                 ) -> DecodeBuffers:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        buffers = cls(zeros(max_size, dtype=torch.int64), zeros(max_size, dtype=torch.int64),
                      [zeros(max_size, dtype=torch.int64) for _ in range(num_groups)],
                      [zeros(max_size, max_blocks_per_seq, dtype=torch.int32) for _ in range(num_groups)],
                      zeros(max_size, dtype=torch.int32))
        buffers.pad(0, max_size)
        return buffers

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.slot_mappings[0]

    @property
    def block_table(self) -> torch.Tensor:
        return self.block_tables[0]

    def pad(self, start: int, stop: int) -> None:
        """Make rows [start, stop) padding rows."""
        self.input_ids[start:stop] = 0
        self.positions[start:stop] = 0
        for slot_mapping, block_table in zip(self.slot_mappings, self.block_tables):
            slot_mapping[start:stop] = PADDING_SLOT
            block_table[start:stop, 0] = 0
        self.seq_lens[start:stop] = 1

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mappings: Sequence[torch.Tensor],
             block_tables: Sequence[torch.Tensor], seq_lens: torch.Tensor, size: int) -> None:
        """Rows [0, n) from one decode step's inputs (n requests, one token each; a slot mapping and a block
        table per group), rows [n, size) padding."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        for own, new in zip(self.slot_mappings, slot_mappings):
            own[:n].copy_(new)
        # Entries past a row's own blocks keep older values: the kernel reads only the blocks its length needs.
        for own, new in zip(self.block_tables, block_tables):
            own[:n, :new.shape[1]].copy_(new)
        self.seq_lens[:n].copy_(seq_lens)
        self.pad(n, size)

    def metadata(self, size: int) -> DecodeGraphMetadata | list[DecodeGraphMetadata]:
        """The attention inputs of a graph of `size`: one per group, as a list when there are several (each layer
        reads its group's)."""
        per_group = [DecodeGraphMetadata(slot_mapping=slot_mapping[:size], block_table=block_table[:size],
                                         seq_lens=self.seq_lens[:size])
                     for slot_mapping, block_table in zip(self.slot_mappings, self.block_tables)]
        return per_group[0] if len(per_group) == 1 else per_group


def decode_forward(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                    attn_metadata: DecodeGraphMetadata) -> torch.Tensor:
    """What a graph computes: the model's forward on a decode batch (compiled once per size)."""
    return model(input_ids, positions, attn_metadata)


def _stop_compiler(compiler: _CompilerThread, cancel: Callable[[], None] | None, wait: bool = True) -> None:
    """Stop `compiler`, first killing a compile that runs in a child process (`cancel`, when the capture has one)."""
    if cancel is not None:
        cancel()
    compiler.stop(wait)


class DecodeGraphs:
    """The compiled decode graphs of one model runner: which sizes exist, compiling them, running a step."""

    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 capture: GraphCapture | None = None, num_kv_cache_groups: int = 1) -> None:
        """`capture`: how a size's graph is built (default: CUDA graphs on CUDA, inductor elsewhere)."""
        self.model = model
        self.device = device
        self.sizes = capture_sizes(max_num_seqs, device.type)
        self.buffers = DecodeBuffers.allocate(self.sizes[-1], max_blocks_per_seq, device, num_kv_cache_groups)
        forward = own_copy(decode_forward, f"decode_forward_{id(self):x}")
        if capture is None:
            capture = CudaGraphs(forward) if device.type == "cuda" else InductorGraphs(forward, len(self.sizes))
        self._capture = capture
        self._ready: set[int] = set()
        self._queued: set[int] = set()
        self._failed: dict[int, str] = {}
        self._lock = threading.Lock()
        self._stepping = False
        self._last_step = 0.0  # time.monotonic() when the last step ended
        graphs = weakref.ref(self)  # the compiler must not hold these graphs (and the model) alive
        self._compiler = _CompilerThread(lambda: (g := graphs()) is None or g.idle())
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


class _CompilerThread:
    """The background compiler: compiles the sizes submitted to it one at a time, each once `ready()` says so (the
    engine is idle), each in a thread of its own that ends after it.

    A thread per compile, and none kept waiting after one, because a thread that has run torch's parallel ops keeps
    its own OpenMP team while it lives, and with more OpenMP threads than cores libgomp stops spinning between
    parallel regions: every region of every later step would then pay a sleeping thread's wake-up (~70 µs here; see
    `vx.platform.prefer_openmp_wait_policy`). A thread waiting for `ready()` has run none yet.
    """

    def __init__(self, ready: Callable[[], bool] = lambda: True) -> None:
        self._ready = ready
        self._lock = threading.Lock()
        # (size, the compile to run); nothing of it is kept once run, so an idle compiler holds no model alive.
        self._pending: deque[tuple[int, Callable[[int], None]]] = deque()
        self._stopped = False
        self.thread: threading.Thread | None = None

    @property
    def stopped(self) -> bool:
        return self._stopped

    def submit(self, size: int, compile_fn: Callable[[int], None]) -> None:
        """Queue `compile_fn(size)`, starting a thread if none runs; ignored once stopped."""
        with self._lock:
            if self._stopped:
                return
            self._pending.append((size, compile_fn))
            if self.thread is None:
                self._start_locked()

    def stop(self, wait: bool = False) -> None:
        """Drop the queued sizes; with `wait`, wait for the compile in progress (if any) to end."""
        with self._lock:
            self._stopped = True
            self._pending.clear()
            thread = self.thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()

    def _start_locked(self) -> None:
        self.thread = threading.Thread(target=self._run_one, name="vx-decode-compile", daemon=True)
        self.thread.start()

    def _next(self) -> tuple[int, Callable[[int], None]] | None:
        """The next compile, once the engine is idle; None (this thread ends) when stopped or nothing is queued."""
        while True:
            with self._lock:
                if self._stopped or not self._pending:
                    self.thread = None
                    return None
                if self._ready():
                    return self._pending.popleft()
            time.sleep(_IDLE_POLL_S)

    def _run_one(self) -> None:
        job = self._next()
        if job is None:
            return
        size, compile_fn = job
        # While this thread compiles (mostly Python), every torch op of an eager step that releases the GIL waits up
        # to a whole switch interval (5 ms) to get it back: hundreds a step. A short interval for the compile's
        # duration keeps a step that comes meanwhile near its speed.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(_COMPILE_SWITCH_INTERVAL_S)
        try:
            compile_fn(size)
        finally:
            sys.setswitchinterval(interval)
            with self._lock:
                if self._pending and not self._stopped:
                    self._start_locked()  # the next size gets a fresh thread, with no OpenMP team yet
                else:
                    self.thread = None
