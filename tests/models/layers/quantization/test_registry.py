"""The quantization registry: every row names a method whose config class imports, the rows agree with each other,
no other module lists the method names, and reading the registry imports no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.registry_scan import name_lists
from vx.class_path import load_class
from vx.models.layers.quantization.base_config import QuantizationConfig
from vx.models.layers.quantization.registry import (METHODS, QUANTIZATION_NAMES, QuantizationMethod, SliceAlignment,
                                                    quantization_method)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_each_row_names_its_config_class(method: QuantizationMethod):
    cls = load_class(method.config_class, QuantizationConfig, "config_class")
    assert cls.name == method.name
    assert quantization_method(method.name) is method


def test_the_rows_are_consistent():
    assert len(set(QUANTIZATION_NAMES)) == len(METHODS)
    assert QUANTIZATION_NAMES == tuple(m.name for m in METHODS)
    for method in METHODS:
        # A method splits, or says why not; one that does not split asks no alignment.
        assert method.splits != bool(method.not_split_reason), method.name
        if not method.splits:
            assert method.alignment({}) == SliceAlignment(), method.name
        else:
            assert method.alignment({}).multiple >= 1, method.name
    with pytest.raises(ValueError, match="Quantization method 'nf4' is not supported; supported: gguf, awq"):
        quantization_method("nf4")


def test_no_other_module_lists_the_method_names():
    assert name_lists(set(QUANTIZATION_NAMES), skip={"vx/models/layers/quantization/registry.py"}) == []


def test_reading_the_registry_imports_no_torch():
    code = ("import sys, vx.models.layers.quantization.registry, vx.models.layers.quantization.tp_split, "
            "vx.gpu.attention.registry; assert 'torch' not in sys.modules, 'torch'")
    subprocess.run([sys.executable, "-c", code], check=True)
