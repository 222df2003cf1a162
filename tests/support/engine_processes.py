"""Helpers shared by the tests that start engine processes (AsyncLLM, the multiprocess clients, the engine core,
the end-to-end streams; not fixtures: plain functions): engine arguments for the tiny models, and checks on the
processes a test leaves behind."""

from __future__ import annotations

import os
import signal
import subprocess
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


def kill_parent_expect_engine_gone(parent: subprocess.Popen, ipc_root: str) -> None:
    """`parent` printed its engine's pid and keeps its ipc dir under `ipc_root`: SIGKILL it, then the engine
    must exit by itself and remove the ipc dir (no orphan, no socket files left)."""
    try:
        line = parent.stdout.readline().strip()
        assert line, "the parent process failed to start its engine"
        pid = int(line)
        assert not process_gone(pid) and len(os.listdir(ipc_root)) == 1
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert wait_until(lambda: process_gone(pid), timeout=5.0), "the engine outlived its parent"
        assert wait_until(lambda: not os.listdir(ipc_root), timeout=2.0), "the ipc dir was left behind"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
