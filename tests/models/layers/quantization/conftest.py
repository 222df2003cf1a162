"""A tiny float model whose linear layers take groups of 32, 64 and 128, built once per session: the quantized
checkpoints of these tests are made from its weights."""

from __future__ import annotations

import pytest

from tests.support.quantized_checkpoints import make_float_model


@pytest.fixture(autouse=True)
def float_activations(monkeypatch):
    """These tests check that each format's weights are read as the float weights they stand for, to float rounding
    (a wrong nibble, scale or zero moves logits by 0.1 or more): on the C kernel's exact float path. The int8-
    activation path (VX_CPU_MATMUL=auto on a VNNI CPU) adds x's int8 rounding, ~1% of a product, which flips
    near-tied greedy tokens; its accuracy is checked against a derived bound in tests/kernels and
    tests/models/layers/test_quantization_kernels.py."""
    monkeypatch.setenv("VX_CPU_MATMUL", "float")


@pytest.fixture(scope="session")
def float_model_dir(tmp_path_factory) -> str:
    return make_float_model(tmp_path_factory.mktemp("quant-float"), "llama")


@pytest.fixture(scope="session")
def realistic_model_dir(tmp_path_factory) -> str:
    """The same shape with weights of the spread trained models have (std 0.02), where quantization error stays
    proportionate instead of growing through the layers as in the peaked tiny models."""
    return make_float_model(tmp_path_factory.mktemp("quant-float-0.02"), "llama", initializer_range=0.02)
