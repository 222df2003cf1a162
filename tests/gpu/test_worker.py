"""Worker: device set-up, KV cache sizing from the config, and the step it runs through its ModelRunner."""

from __future__ import annotations

import re

import pytest
import torch

from vx.config import EngineArgs
from vx.gpu.worker import Worker
from vx.sampling_params import SamplingParams
from vx.step import NewRequestData, SchedulerOutput

BS = 4


def make_worker(tiny_model_dir, **engine_args) -> Worker:
    args = dict(model=tiny_model_dir, dtype="float32", device="cpu", max_model_len=64, block_size=BS, max_num_seqs=2)
    worker = Worker(EngineArgs(**{**args, **engine_args}).create_config())
    worker.init_device()
    worker.load_model()
    return worker


def test_num_kv_blocks_is_taken_as_given(tiny_model_dir):
    size = make_worker(tiny_model_dir, num_kv_blocks=40).determine_kv_cache_size()
    assert size.num_blocks == 40 and size.source == "num_kv_blocks"


def test_a_memory_budget_gives_as_many_blocks_as_can_be_used(tiny_model_dir):
    worker = make_worker(tiny_model_dir)
    per_block = worker.model_runner.kv_cache_bytes_per_block()
    useful = 2 * (64 // BS) + 1  # max_num_seqs sequences of max_model_len, and the padding block
    worker.config.cache_config.kv_cache_memory_bytes = per_block * 1000
    assert worker.determine_kv_cache_size().num_blocks == useful
    worker.config.cache_config.kv_cache_memory_bytes = per_block * 20 + per_block // 2
    size = worker.determine_kv_cache_size()
    assert size.num_blocks == 20 and size.source == "kv_cache_memory_bytes" and size.bytes_per_block == per_block


def test_a_budget_below_one_sequence_is_refused(tiny_model_dir):
    worker = make_worker(tiny_model_dir)
    worker.config.cache_config.kv_cache_memory_bytes = worker.model_runner.kv_cache_bytes_per_block() * 10
    with pytest.raises(ValueError, match=re.escape("holds 10 blocks, fewer than one sequence of max_model_len=64 "
                                                   "needs (17)")):
        worker.determine_kv_cache_size()


def test_the_cpu_default_comes_from_need(tiny_model_dir):
    """max_num_seqs sequences of min(max_model_len, 512) tokens, at least one max_model_len sequence."""
    size = make_worker(tiny_model_dir).determine_kv_cache_size()
    assert size.source == "need" and size.num_blocks == 2 * (64 // BS) + 1
    size = make_worker(tiny_model_dir, max_num_seqs=8, max_model_len=1024).determine_kv_cache_size()
    assert size.source == "need" and size.num_blocks == 8 * (512 // BS) + 1


def test_the_cpu_default_budget_is_bounded(tiny_model_dir):
    worker = make_worker(tiny_model_dir, max_num_seqs=256, max_model_len=1024)
    size = worker.determine_kv_cache_size()
    assert 0 < size.num_bytes <= 4 * 1024**3


def test_the_worker_runs_torch_on_the_configured_cpu_threads(tiny_model_dir):
    before = torch.get_num_threads()
    config = EngineArgs(model=tiny_model_dir, dtype="float32", device="cpu", max_model_len=64, block_size=BS,
                        max_num_seqs=2).create_config()
    assert config.device_config.cpu_threads >= 1
    config.device_config.cpu_threads = 1 if before != 1 else 2
    try:
        Worker(config).init_device()
        assert torch.get_num_threads() == config.device_config.cpu_threads
    finally:
        torch.set_num_threads(before)


def test_a_step_runs_through_the_worker_and_seeds_torch(tiny_model_dir):
    worker = make_worker(tiny_model_dir, num_kv_blocks=40, seed=7)
    assert torch.initial_seed() == 7
    worker.initialize_kv_cache(40)
    plan = SchedulerOutput(scheduled_new_reqs=[NewRequestData(
        req_id="a", prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(temperature=0.0), block_ids=[[1]],
        num_computed_tokens=0)], scheduled_cached_reqs=[], num_scheduled_tokens={"a": 3}, total_num_scheduled_tokens=3)
    out = worker.execute_model(plan)
    assert out.req_ids == ["a"] and len(out.sampled_token_ids) == 1
    worker.shutdown()
    assert worker.model_runner is None
