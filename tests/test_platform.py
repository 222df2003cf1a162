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


def test_passive_openmp_wait_only_before_torch(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    platform.prefer_passive_openmp_wait()  # torch is loaded in this process: too late to matter, left alone
    assert "OMP_WAIT_POLICY" not in os.environ
    code = ("import os; from vx import platform; platform.prefer_passive_openmp_wait(); "
            "print(os.environ['OMP_WAIT_POLICY'])")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "PASSIVE"


def test_cpu_flags_are_words():
    flags = platform.cpu_flags()
    assert isinstance(flags, tuple) and all(f and " " not in f for f in flags)
