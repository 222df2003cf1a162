"""Whether a runner gets decode graphs (vx.gpu.graphs.build): none with `enforce_eager` or `VX_DECODE_COMPILE=off`,
and an unknown `VX_DECODE_COMPILE` refused."""

from __future__ import annotations

import pytest

import vx
from tests.support.decode_graphs import runner


def test_enforce_eager_and_off_compile_nothing(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("VX_DECODE_COMPILE", "background")
    llm = vx.LLM(tiny_model_dir, dtype="float32", device="cpu", enforce_eager=True)
    try:
        assert runner(llm).decode_graphs is None
    finally:
        llm.shutdown()
    monkeypatch.setenv("VX_DECODE_COMPILE", "off")
    llm = vx.LLM(tiny_model_dir, dtype="float32", device="cpu")
    try:
        assert runner(llm).decode_graphs is None
    finally:
        llm.shutdown()


def test_invalid_decode_compile_setting_is_refused(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("VX_DECODE_COMPILE", "sometimes")
    with pytest.raises(Exception, match="VX_DECODE_COMPILE"):
        vx.LLM(tiny_model_dir, dtype="float32", device="cpu")

