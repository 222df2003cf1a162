"""How many OpenMP threads one call of a C kernel should use: all of torch's, or one when waking them costs more.

vx lets OpenMP threads spin about a millisecond after a parallel region and then sleep (`OMP_WAIT_POLICY=PASSIVE`
with `GOMP_SPINCOUNT`, `vx.platform.prefer_openmp_wait_policy`), so that the engine never spins long against the
application. Within a step the threads are still spinning when the next call comes, and waking them costs a few µs.
Where they sleep at once (PASSIVE without a spin count, as the test suite runs), waking a sleeping thread costs
~60-80 µs on the 2-core VMs measured here (`python -m benchmarks.quant_matmul --threads 1` vs `--threads 2`: a
576x576 int4 matmul at batch 1 took 31 µs on one thread and 94 µs on two), so the many small calls of a batch-1
decode step run faster on the calling thread alone. A call goes parallel when its estimated single-thread time is
worth the wake-up: serial / n + wake < serial.
"""

from __future__ import annotations

import functools
import os

import torch

# Waking OpenMP threads, in µs: sleeping ones (PASSIVE, vx's default) and spinning ones (ACTIVE or a spin count).
_WAKE_US_PASSIVE = 80.0
_WAKE_US_SPINNING = 5.0


@functools.cache
def wake_cost_us() -> float:
    """What waking the OpenMP team costs a call, from the wait policy the runtime started with: threads that sleep
    at once (PASSIVE without a spin count) or ones that spin a while first (libgomp's GOMP_SPINCOUNT)."""
    passive = os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"
    spins = os.environ.get("GOMP_SPINCOUNT", "").strip()
    return _WAKE_US_PASSIVE if passive and spins in ("", "0") else _WAKE_US_SPINNING


def min_parallel_us(threads: int | None = None) -> float:
    """The single-thread time (µs) above which `threads` threads (default torch's) finish a call sooner."""
    n = threads or torch.get_num_threads()
    return float("inf") if n <= 1 else wake_cost_us() * n / (n - 1)


def threads_for(serial_us: float) -> int:
    """torch's thread count for a call whose single-thread time is about `serial_us`, or 1 if that is too short."""
    n = torch.get_num_threads()
    return n if serial_us >= min_parallel_us(n) else 1
