"""Helpers shared by the AsyncLLM / multiprocess-client tests (not fixtures: plain functions)."""

from __future__ import annotations

import time

import psutil

ENGINE_KWARGS = dict(dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=400, block_size=16)


def child_pids() -> set[int]:
    """Pids of this process's live children, leaving out multiprocessing's resource tracker (it is Python's
    own helper, shared by every spawn, and lives as long as this process)."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            if any("resource_tracker" in part for part in child.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        pids.add(child.pid)
    return pids


def process_gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie that nobody reaped yet counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    """Poll `predicate` until it holds or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system

