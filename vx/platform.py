"""Device, dtype and CPU-feature questions.

Importing this module imports no torch: the application's process asks some of these questions too, and
answers them without torch where it can (`resolve_device` on a machine with no NVIDIA driver).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16")
"""The dtypes a model runs in, by their torch names."""


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a name in DTYPE_NAMES (a "torch." prefix allowed); a torch dtype is returned as is."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"Unsupported dtype {dtype!r}; use one of {', '.join(DTYPE_NAMES)}.")
    return getattr(torch, name)


def resolve_device(device: str) -> str:
    """'cpu' or 'cuda' for the user's `device` ('auto' picks CUDA when torch sees a device)."""
    if device == "auto" and not may_have_cuda():
        return "cpu"  # and torch (seconds to import) stays out of the application's process
    if device != "auto":
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("device='cuda' was asked for but CUDA is not available.")
        return device
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover - torch is a dependency
        return "cpu"


def may_have_cuda() -> bool:
    """False when this machine surely has no CUDA device: no NVIDIA driver is loaded and none is visible."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl") \
        or sys.platform not in ("linux", "darwin")  # elsewhere we cannot tell cheaply: ask torch


def resolve_dtype(dtype: str, device: str, hf_config: Any) -> str:
    """A name in DTYPE_NAMES for the user's `dtype`; 'auto' depends on the device and the checkpoint."""
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "bfloat16" if cpu_has_native_bf16() else "float32"
    cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    name = str(cfg).replace("torch.", "") if cfg is not None else "bfloat16"
    return name if name in ("bfloat16", "float16") else "bfloat16"


def cpu_flags() -> tuple[str, ...]:
    """The CPU's feature flags as /proc/cpuinfo lists them (what -march=native compiles for); empty elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return tuple(line.split(":", 1)[1].split())
    except OSError:
        pass
    return ()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX or AVX512-BF16).

    Measured (`vx bench roofline --dtypes float32,bfloat16`): with AMX, bf16 GEMMs run ~3-4x faster than
    float32; without these units torch emulates bf16 and float32 is faster, so it stays the CPU default.
    """
    flags = cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def available_cpu_cores(cpus: Iterable[int] | None = None, sys_cpu_dir: str = "/sys/devices/system/cpu",
                        cpu_max_file: str = "/sys/fs/cgroup/cpu.max") -> int:
    """Physical cores this process may run on: the CPUs of its affinity mask (`cpus`), hyperthread siblings counted
    once, and no more than its cgroup's CPU quota allows; at least 1.

    torch's own default counts physical cores too (two threads of one core share its FMA units), but those of the
    whole machine, whatever the affinity mask or a container's quota say: a process pinned to 4 CPUs of a 64-core
    machine then runs 64 OpenMP threads on 4 CPUs, and every op waits at its barrier for the threads that wait for a
    time slice. Siblings come from /sys's topology (`core_cpus_list`, or `thread_siblings_list` on older kernels),
    the quota from cgroup v2's `cpu.max`; where either is missing, every CPU of the mask counts.
    """
    if cpus is None:
        try:
            cpus = os.sched_getaffinity(0)
        except (AttributeError, OSError):  # not Linux
            cpus = range(os.cpu_count() or 1)
    cores: set[tuple[str, str] | int] = set()
    for cpu in cpus:
        topology = os.path.join(sys_cpu_dir, f"cpu{cpu}", "topology")
        siblings = _read_first_line(os.path.join(topology, "core_cpus_list")) \
            or _read_first_line(os.path.join(topology, "thread_siblings_list"))
        package = _read_first_line(os.path.join(topology, "physical_package_id"))
        cores.add((package, siblings) if siblings else cpu)
    count = max(1, len(cores))
    quota = _read_first_line(cpu_max_file).split()  # "max 100000" or "200000 100000": quota and period in µs
    if len(quota) == 2 and quota[0].isdigit() and quota[1].isdigit() and int(quota[1]) > 0:
        count = min(count, max(1, -(-int(quota[0]) // int(quota[1]))))
    return count


def cpu_threads() -> int:
    """Torch's CPU threads in the engine: `OMP_NUM_THREADS` when it is set to a positive number (the user chose;
    torch reads it too), else `available_cpu_cores()`."""
    chosen = os.environ.get("OMP_NUM_THREADS", "").strip()
    if chosen.isdigit() and int(chosen) > 0:
        return int(chosen)
    return available_cpu_cores()


def _read_first_line(path: str) -> str:
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return ""


# How long an OpenMP thread spins after a parallel region before it sleeps, in libgomp's spins (~100,000 a ms).
OPENMP_SPIN_COUNT = 100_000


def prefer_openmp_wait_policy() -> None:
    """Make OpenMP threads spin about a millisecond after each parallel region, then sleep, unless the user chose
    (OMP_WAIT_POLICY or GOMP_SPINCOUNT set); only before torch loads (libgomp reads them once).

    Threads that spin without bound (ACTIVE) collapse as soon as anything else wants a core (another process,
    vx's own front end: 16 streams on 2 cores took 104 s spinning, 8 s passive). Threads that sleep at once
    (PASSIVE alone) cost ~70 µs to wake for every parallel region, hundreds a decode step: the default model's
    compiled batch-1 step took 17.6 ms so and 10.3 ms with this bounded spin, on an idle 2-core machine
    (`benchmarks.decode_step`; docs/performance.md, section (h)). Between steps and when the engine is idle the
    threads sleep as before.
    """
    if "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.environ["GOMP_SPINCOUNT"] = str(OPENMP_SPIN_COUNT)


def release_free_heap() -> None:
    """Hand the memory that the C heap holds free back to the system (glibc's `malloc_trim`; elsewhere nothing).

    Loading a quantized model frees many mid-sized temporaries between the tensors it keeps; glibc keeps such
    holes for reuse, and the process's resident memory stays ~30 MiB higher for the default model without this.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        trim = None
    if trim is not None:
        trim(0)
