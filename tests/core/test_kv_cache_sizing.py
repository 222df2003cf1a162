"""The engine core sizes the KV cache once, from every worker's report: the user's arguments first, else each
rank's memory (the smallest rank wins), with the layer windows of every pipeline stage combined."""

from __future__ import annotations

import re

import pytest

from vx.config import EngineArgs, VxConfig
from vx.core.engine_core import EngineCore
from vx.core.kv_cache_sizing import decide_kv_cache_size, model_layer_windows
from vx.executor import Executor
from vx.gpu.worker import Worker
from vx.kv_spec import KVCacheGroupSpec, KVCacheReport, KVCacheSize

BS = 4
MiB = 2**20


def make_config(tiny_model_dir, **engine_args) -> VxConfig:
    args = dict(model=tiny_model_dir, dtype="float32", device="cpu", max_model_len=64, block_size=BS, max_num_seqs=2)
    return EngineArgs(**{**args, **engine_args}).create_config()


def make_worker(tiny_model_dir, **engine_args) -> Worker:
    worker = Worker(make_config(tiny_model_dir, **engine_args))
    worker.init_device()
    worker.load_model()
    return worker


def size_of(worker: Worker) -> KVCacheSize:
    """What the engine core decides from this one worker's report."""
    return decide_kv_cache_size(worker.config, [worker.kv_cache_report()])


def report(rank: int = 0, stage: int = 0, windows: tuple[int | None, ...] = (None, None), per_block: int = 1024,
           free: int = 64 * MiB) -> KVCacheReport:
    return KVCacheReport(rank=rank, pipeline_stage=stage, device="cpu", layer_windows=windows,
                         bytes_per_block=per_block, memory_total_bytes=free, memory_free_bytes=free)


def test_num_kv_blocks_is_taken_as_given(tiny_model_dir):
    size = size_of(make_worker(tiny_model_dir, num_kv_blocks=40))
    assert size.num_blocks == 40 and size.source == "num_kv_blocks"


def test_a_memory_budget_gives_as_many_blocks_as_can_be_used(tiny_model_dir):
    worker = make_worker(tiny_model_dir)
    per_block = worker.model_runner.kv_cache_bytes_per_block()
    useful = 2 * (64 // BS) + 1  # max_num_seqs sequences of max_model_len, and the padding block
    worker.config.cache_config.kv_cache_memory_bytes = per_block * 1000
    assert size_of(worker).num_blocks == useful
    worker.config.cache_config.kv_cache_memory_bytes = per_block * 20 + per_block // 2
    size = size_of(worker)
    assert size.num_blocks == 20 and size.source == "kv_cache_memory_bytes" and size.bytes_per_block == per_block


def test_a_budget_below_one_sequence_is_refused(tiny_model_dir):
    worker = make_worker(tiny_model_dir)
    worker.config.cache_config.kv_cache_memory_bytes = worker.model_runner.kv_cache_bytes_per_block() * 10
    with pytest.raises(ValueError, match=re.escape("holds 10 blocks, fewer than one sequence of max_model_len=64 "
                                                   "needs (17)")):
        size_of(worker)


def test_the_cpu_default_comes_from_need(tiny_model_dir):
    """max_num_seqs sequences of min(max_model_len, 512) tokens, at least one max_model_len sequence."""
    size = size_of(make_worker(tiny_model_dir))
    assert size.source == "need" and size.num_blocks == 2 * (64 // BS) + 1
    size = size_of(make_worker(tiny_model_dir, max_num_seqs=8, max_model_len=1024))
    assert size.source == "need" and size.num_blocks == 8 * (512 // BS) + 1


def test_the_cpu_default_budget_is_bounded(tiny_model_dir):
    worker = make_worker(tiny_model_dir, max_num_seqs=256, max_model_len=1024)
    size = size_of(worker)
    assert 0 < size.num_bytes <= 4 * 1024**3


def test_the_rank_with_the_least_memory_decides_for_all(tiny_model_dir):
    """Each rank's budget is its share of the CPU cap (a quarter of its RAM, over the world's ranks)."""
    config = make_config(tiny_model_dir, max_num_seqs=256, tensor_parallel_size=2)
    rich, poor = report(rank=0, free=64 * MiB), report(rank=1, free=16 * MiB)
    size = decide_kv_cache_size(config, [rich, poor])
    assert size.source == "cap" and size.num_blocks == 16 * MiB // 4 // 2 // 1024
    assert decide_kv_cache_size(config, [poor, rich]) == size == decide_kv_cache_size(config, [poor])
    assert decide_kv_cache_size(config, [rich]).source == "need"


def test_the_windows_of_every_pipeline_stage_are_combined(tiny_model_dir):
    """Stage 0 holds the full-attention layers, stage 1 the sliding ones: every rank gets both groups, each of the
    whole size (not rebalanced across stages), though no stage alone has both kinds."""
    config = make_config(tiny_model_dir, num_kv_blocks=40, pipeline_parallel_size=2, tensor_parallel_size=2)
    reports = [report(rank=3, stage=1, windows=(8, 8)), report(rank=0, stage=0, windows=(None, None)),
               report(rank=2, stage=1, windows=(8, 8)), report(rank=1, stage=0, windows=(None, None))]
    assert model_layer_windows(reports) == [None, None, 8, 8]
    size = decide_kv_cache_size(config, reports)
    assert size.num_blocks == 40
    assert size.groups == (KVCacheGroupSpec(40, None), KVCacheGroupSpec(40, 8))


def reporting_executor(reports: list[KVCacheReport]) -> type[Executor]:
    """An executor without workers: it hands up `reports` and records what it is told to allocate."""

    class ReportingExecutor(Executor):
        def __init__(self, config: VxConfig) -> None:
            super().__init__(config)
            self.allocated: list[KVCacheSize] = []
            self.shut_down = False

        def kv_cache_reports(self) -> list[KVCacheReport]:
            return list(reports)

        def initialize_kv_cache(self, kv_cache: KVCacheSize) -> None:
            self.allocated.append(kv_cache)

        def execute_model(self, scheduler_output):
            raise AssertionError("no step runs here")

        def shutdown(self) -> None:
            self.shut_down = True

    return ReportingExecutor


def test_the_engine_core_sizes_the_cache_from_the_reports_and_sends_it_down_once(tiny_model_dir):
    config = make_config(tiny_model_dir, max_num_seqs=256, tensor_parallel_size=2)
    reports = [report(rank=0, free=64 * MiB), report(rank=1, free=16 * MiB)]
    core = EngineCore(config, executor_class=reporting_executor(reports))
    try:
        expected = decide_kv_cache_size(config, reports[1:])
        assert core.executor.allocated == [core.kv_cache_size] == [expected]
        assert core.num_kv_blocks == expected.num_blocks == core.stats().kv_blocks_total + 1
    finally:
        core.shutdown()


def test_a_budget_too_small_fails_the_start_and_stops_the_executor(tiny_model_dir):
    config = make_config(tiny_model_dir, tensor_parallel_size=2)
    made: list[Executor] = []
    executor_class = reporting_executor([report(rank=0), report(rank=1, free=MiB // 8)])

    class Recorded(executor_class):
        def __init__(self, config: VxConfig) -> None:
            super().__init__(config)
            made.append(self)

    with pytest.raises(ValueError, match="fewer than one sequence of max_model_len=64"):
        EngineCore(config, executor_class=Recorded)
    assert made[0].shut_down and not made[0].allocated
