"""The attention-backend registry: every row names a backend whose class imports, the rows agree with each other and
with their classes, no other module lists the backend names, and reading the registry imports no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.registry_scan import name_lists
from vx.class_path import load_class
from vx.gpu.attention.backend import AttentionBackend
from vx.gpu.attention.kv_format import KV_CACHE_FORMATS
from vx.gpu.attention.registry import (ATTENTION_BACKEND_NAMES, AUTO, BACKENDS, KV_CACHE_DTYPES,
                                       AttentionBackendEntry, attention_backend, auto_order, fallback_backend,
                                       mla_backend)

# Literals elsewhere whose strings only coincide with backend names: the MLA backend's own decode kernels, and the
# parts of a compiled-graph cache key (torch's version, the CPU's identity).
_COINCIDENCES = {("vx/gpu/attention/mla_backend.py", frozenset({"torch", "triton"})),
                 ("vx/gpu/graphs/aoti_cache.py", frozenset({"torch", "cpu"}))}


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_each_row_names_its_backend_class(backend: AttentionBackendEntry):
    cls = load_class(backend.backend_class, AttentionBackend, "backend_class")
    assert cls.get_name() == backend.name
    assert cls.is_mla == backend.mla
    assert attention_backend(backend.name) is backend


def test_the_rows_are_consistent():
    names = [b.name for b in BACKENDS]
    assert len(set(names)) == len(names) and AUTO not in names
    assert ATTENTION_BACKEND_NAMES == (AUTO, *names)
    # One fallback, one MLA backend, and neither among the backends 'auto' tries first.
    assert [b.name for b in BACKENDS if b.fallback] == [fallback_backend()]
    assert [b.name for b in BACKENDS if b.mla] == [mla_backend()]
    for device_type in ("cuda", "cpu"):
        order = auto_order(device_type)
        assert order and len(set(order)) == len(order)
        assert fallback_backend() not in order and mla_backend() not in order
    orders = [[b.auto_order_cuda for b in BACKENDS], [b.auto_order_elsewhere for b in BACKENDS]]
    for places in orders:
        placed = [p for p in places if p is not None]
        assert len(set(placed)) == len(placed)
    assert set(KV_CACHE_DTYPES) == set(KV_CACHE_FORMATS)
    with pytest.raises(ValueError, match="Unknown attention_backend 'xformers'; choose one of: auto, torch"):
        attention_backend("xformers")


def test_no_other_module_lists_the_backend_names():
    names = {b.name for b in BACKENDS}
    assert name_lists(names, skip={"vx/gpu/attention/registry.py"}, allowed=_COINCIDENCES) == []


def test_reading_the_registry_imports_no_torch():
    code = ("import sys, vx.gpu.attention.registry, vx.models.layers.quantization.registry; "
            "assert 'torch' not in sys.modules, 'torch'")
    subprocess.run([sys.executable, "-c", code], check=True)
