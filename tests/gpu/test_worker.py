"""Worker: device set-up, its KV cache report, and the step it runs through its ModelRunner."""

from __future__ import annotations

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


def test_the_worker_reports_its_layers_block_bytes_and_memory(tiny_model_dir):
    """The worker measures and reports; the engine core sizes the cache from the report (tests/core)."""
    worker = make_worker(tiny_model_dir)
    report = worker.kv_cache_report()
    assert report.device == "cpu" and report.rank == 0 and report.pipeline_stage == 0
    assert report.bytes_per_block == worker.model_runner.kv_cache_bytes_per_block()
    assert list(report.layer_windows) == worker.model_runner.layer_windows()
    assert 0 < report.memory_free_bytes <= report.memory_total_bytes


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
