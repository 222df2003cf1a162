"""EngineArgs -> VxConfig: the request-isolation limits (max_n_sequences, grammar compile limits) are validated
and land in one config place each."""

from __future__ import annotations

import pytest

from vx.config import EngineArgs, default_grammar_compile_workers


@pytest.mark.parametrize("name, value", [
    ("max_n_sequences", 0), ("max_n_sequences", 1.5), ("max_n_sequences", True), ("max_n_sequences", 2**63),
    ("grammar_cache_memory_bytes", 0), ("grammar_cache_memory_bytes", None),
    ("max_grammar_memory_bytes", -1), ("max_grammar_memory_bytes", "1"),
    ("grammar_compile_timeout_s", 0), ("grammar_compile_timeout_s", -1.0), ("grammar_compile_timeout_s", float("nan")),
    ("grammar_compile_timeout_s", float("inf")), ("grammar_compile_timeout_s", True),
    ("grammar_compile_timeout_s", None),
    ("grammar_compile_workers", 0), ("grammar_compile_workers", 1.0),
])
def test_bad_limits_are_refused_with_their_name(tiny_model_dir, name, value):
    with pytest.raises(ValueError, match=name):
        EngineArgs(model=tiny_model_dir, **{name: value}).validate()


def test_limits_reach_the_config(tiny_model_dir):
    config = EngineArgs(model=tiny_model_dir, device="cpu", max_n_sequences=3, grammar_cache_memory_bytes=1000,
                        max_grammar_memory_bytes=100, grammar_compile_timeout_s=2,
                        grammar_compile_workers=5).create_config(light=True)
    assert config.scheduler_config.max_n_sequences == 3
    so = config.structured_outputs_config
    assert (so.cache_memory_bytes, so.max_grammar_memory_bytes, so.compile_timeout_s, so.compile_workers) == \
        (1000, 100, 2.0, 5)


def test_defaults(tiny_model_dir):
    config = EngineArgs(model=tiny_model_dir, device="cpu").create_config(light=True)
    so = config.structured_outputs_config
    assert config.scheduler_config.max_n_sequences == 128
    assert (so.cache_memory_bytes, so.max_grammar_memory_bytes, so.compile_timeout_s) == (256 * 2**20, 64 * 2**20,
                                                                                          10.0)
    # At least two compiles run at once, so that one slow compile never holds up the others.
    assert so.compile_workers == default_grammar_compile_workers() >= 2
