"""vx/platform.py: dtype names, device and dtype resolution, CPU features; importing it loads no torch."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from vx import platform


def test_dtype_names_map_to_torch():
    assert [platform.torch_dtype(n) for n in platform.DTYPE_NAMES] == [torch.float32, torch.bfloat16, torch.float16]
    assert platform.torch_dtype("torch.bfloat16") is torch.bfloat16
    assert platform.torch_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="use one of float32, bfloat16, float16"):
        platform.torch_dtype("int3")


def test_resolve_dtype(monkeypatch):
    assert platform.resolve_dtype("float16", "cpu", None) == "float16"
    half = SimpleNamespace(torch_dtype="float16")
    assert platform.resolve_dtype("auto", "cuda", half) == "float16"
    assert platform.resolve_dtype("auto", "cuda", SimpleNamespace(dtype="float32")) == "bfloat16"
    monkeypatch.setattr(platform, "cpu_flags", lambda: ("fpu", "amx_bf16"))
    assert platform.resolve_dtype("auto", "cpu", half) == "bfloat16"
    monkeypatch.setattr(platform, "cpu_flags", lambda: ("fpu", "avx2"))
    assert platform.resolve_dtype("auto", "cpu", half) == "float32"


def test_no_visible_device_means_cpu_without_torch(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not platform.may_have_cuda()
    code = "import sys; from vx import platform; print(platform.resolve_device('auto'), 'torch' in sys.modules)"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="-1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["cpu", "False"]


def test_bounded_openmp_spin_only_before_torch_and_only_unless_the_user_chose(monkeypatch):
    """Threads spin ~1 ms, then sleep (PASSIVE with a spin count); set in a process before torch loads, never over
    a user's OMP_WAIT_POLICY or GOMP_SPINCOUNT."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    platform.prefer_openmp_wait_policy()  # torch is loaded in this process: too late to matter, left alone
    assert "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ
    code = ("import os; from vx import platform; platform.prefer_openmp_wait_policy(); "
            "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))")
    bare = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    for chosen, expected in [({}, f"PASSIVE {platform.OPENMP_SPIN_COUNT}"),
                             ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE None"),
                             ({"GOMP_SPINCOUNT": "0"}, "None 0")]:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**bare, **chosen},
                             check=True).stdout
        assert out.strip() == expected


def test_cpu_flags_are_words():
    flags = platform.cpu_flags()
    assert isinstance(flags, tuple) and all(f and " " not in f for f in flags)


def _fake_topology(root, siblings: dict[int, str], package: str = "0") -> str:
    """A /sys/devices/system/cpu with `cpuN/topology/core_cpus_list` for each CPU: `siblings[N]`."""
    for cpu, group in siblings.items():
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "core_cpus_list").write_text(group + "\n")
        (topology / "physical_package_id").write_text(package + "\n")
    return str(root)


def test_available_cpu_cores_counts_hyperthread_siblings_once(tmp_path):
    # 4 CPUs on 2 cores: 0 and 2 share a core, 1 and 3 the other (Linux numbers siblings this way).
    sys_dir = _fake_topology(tmp_path / "cpu", {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})
    no_quota = str(tmp_path / "no-cpu.max")
    assert platform.available_cpu_cores({0, 1, 2, 3}, sys_dir, no_quota) == 2
    assert platform.available_cpu_cores({0, 2}, sys_dir, no_quota) == 1  # the affinity mask: one core's two threads
    assert platform.available_cpu_cores({0, 1}, sys_dir, no_quota) == 2
    # No topology for these CPUs: each counts.
    assert platform.available_cpu_cores({5, 6, 7}, sys_dir, no_quota) == 3


def test_available_cpu_cores_respects_the_cgroup_quota(tmp_path):
    sys_dir = _fake_topology(tmp_path / "cpu", {i: str(i) for i in range(8)})
    quota = tmp_path / "cpu.max"
    quota.write_text("max 100000\n")
    assert platform.available_cpu_cores(range(8), sys_dir, str(quota)) == 8
    quota.write_text("150000 100000\n")  # 1.5 CPUs of time: 2 threads
    assert platform.available_cpu_cores(range(8), sys_dir, str(quota)) == 2
    quota.write_text("50000 100000\n")
    assert platform.available_cpu_cores(range(8), sys_dir, str(quota)) == 1


def test_available_cpu_cores_here_is_within_the_affinity_mask():
    assert 1 <= platform.available_cpu_cores() <= len(os.sched_getaffinity(0))


def test_cpu_threads_takes_omp_num_threads_first(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert platform.cpu_threads() == 3
    for unusable in ("", "0", "two"):
        monkeypatch.setenv("OMP_NUM_THREADS", unusable)
        assert platform.cpu_threads() == platform.available_cpu_cores()
