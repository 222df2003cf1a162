"""The multiprocess executor end to end: a model split over worker processes (2 tensor-parallel ranks, or 2
pipeline stages; gloo on the CPU) gives exactly the greedy tokens of the whole model in one process, and the same
logprobs within 1e-5, through chunked prefill and preemption; shutdown leaves no process behind."""

from __future__ import annotations

import psutil
import pytest
from tests.support.engine_processes import child_pids
from tests.support.parallel_runs import assert_same, run, tolerance


@pytest.mark.slow
@pytest.mark.parametrize("family, split", [("llama", "tp2"), ("llama", "pp2"), ("qwen3", "tp2"), ("qwen3", "pp2"),
                                           ("llama3_tied", "pp2"), ("qwen3_moe", "tp2"), ("qwen3_moe", "pp2"),
                                           ("mixtral", "tp2")])
def test_split_model_equals_the_whole_model(model_dirs, whole_model, family, split):
    parallel = {"tp2": dict(tensor_parallel_size=2), "pp2": dict(pipeline_parallel_size=2)}[split]
    before = child_pids()
    workers: list[list[str]] = []

    def record_workers(llm) -> None:
        workers.extend(psutil.Process(pid).cmdline() for pid in child_pids() - before)

    outs, stats = run(model_dirs[family], on_engine=record_workers, **parallel)
    # One worker process per rank, each started as its own module (not a multiprocessing spawn of this one).
    assert len(workers) == 2 and all(cmd[-2:] == ["-m", "vx.executor.worker_main"] for cmd in workers), workers
    assert child_pids() <= before, "shutdown left a worker process"
    assert stats.num_preemptions > 0, "the KV cache was meant to be too small to avoid preemption"
    assert stats.kv_blocks_in_use == 0
    assert_same(outs, whole_model(family), tolerance(family))
