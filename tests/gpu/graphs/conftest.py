"""Decode-graph fixtures: what costs a compile is made once per session and copied by the tests that start from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.decode_graphs import TINY_KV_BLOCKS, aoti_engine_in_process_of_its_own


@pytest.fixture(scope="session")
def tiny_package(tiny_model_dir, tmp_path_factory) -> tuple[Path, dict]:
    """A cache holding the tiny model's one decode-graph package (`max_num_seqs=1`, `TINY_KV_BLOCKS`), compiled
    once for the tests that start from a compiled package (each copies it), and what the engine process that
    compiled it reported."""
    cache = tmp_path_factory.mktemp("aoti-cache")
    return cache, aoti_engine_in_process_of_its_own(tiny_model_dir, cache, [[5, 6, 7]], max_num_seqs=1,
                                                    num_kv_blocks=TINY_KV_BLOCKS)
