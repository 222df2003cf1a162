"""EngineCore in this process: what its start-up log reports."""

from __future__ import annotations

import logging

import pytest

from vx.config import EngineArgs
from vx.core.engine_core import EngineCore


@pytest.mark.parametrize("engine_args, why", [
    ({}, "from need: max(max_num_seqs=2 x 64 tokens, one max_model_len=64 sequence), under the CPU cap of "),
    ({"num_kv_blocks": 40}, "as num_kv_blocks asks"),
])
def test_the_ready_line_reports_the_kv_cache_size_and_why(tiny_model_dir, caplog, engine_args, why):
    config = EngineArgs(model=tiny_model_dir, device="cpu", dtype="float32", max_model_len=64, block_size=4,
                        max_num_seqs=2, **engine_args).create_config()
    with caplog.at_level(logging.INFO, logger="vx.core.engine_core"):
        core = EngineCore(config)
    try:
        size = core.kv_cache_size
        assert core.num_kv_blocks == size.num_blocks == engine_args.get("num_kv_blocks", 2 * 16 + 1)
        (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("vx engine ready")]
        mib = size.num_blocks * size.bytes_per_block / 2**20
        assert f": KV cache {mib:,.1f} MiB: {size.num_blocks} KV blocks of 4 tokens " \
               f"({(size.num_blocks - 1) * 4} tokens), " in line
        assert why in line
        assert line.startswith("vx engine ready in ") and f"s ({config.device_config.cpu_threads} CPU threads): " in line
    finally:
        core.shutdown()
