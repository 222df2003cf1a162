"""A worker owns one device: it sets it up, reports what the KV cache may take, allocates the size the engine core
decides, and runs its ModelRunner."""

from __future__ import annotations

import logging

import psutil
import torch

from vx.config import VxConfig
from vx.distributed import ParallelGroups
from vx.gpu.kernel_builds import build_cpu_kernels
from vx.gpu.model_runner import ModelRunner
from vx.kv_spec import KVCacheGroupSpec, KVCacheReport
from vx.step import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class Worker:
    """Device set-up, the KV cache's report and allocation, and model execution for one device: the whole model, or
    one rank's part of it (`groups`: its tensor-parallel shard of its pipeline stage)."""

    def __init__(self, config: VxConfig, groups: ParallelGroups | None = None, local_rank: int = 0) -> None:
        self.config = config
        self.groups = groups
        world = config.parallel_config.world_size
        device = torch.device(config.device_config.device)
        if device.type == "cuda" and device.index is None:
            # torch.cuda.set_device needs an index: a rank's own GPU, else the current device as torch reads it.
            device = torch.device("cuda", local_rank if world > 1 else torch.cuda.current_device())
        self.device = device
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        torch.manual_seed(self.config.model_config.seed)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # The workers of one machine share its cores: each takes its share (at least one thread).
        threads = self.config.device_config.cpu_threads
        if threads:
            threads = max(1, threads // self.config.parallel_config.world_size)
        if self.device.type == "cpu" and threads and torch.get_num_threads() != threads:
            # Before the model loads: the C kernels' OpenMP loops take torch's count at each call.
            torch.set_num_threads(threads)
        if self.device.type == "cpu" and (self.groups is None or self.groups.rank == 0):
            # Before the runner picks its attention backend (which loads that kernel) and the model loads: all of
            # them at once, in parallel. The other ranks of a split model find them built (or wait for a build).
            build_cpu_kernels(self.config)
        self.model_runner = ModelRunner(self.config, self.device, self.groups)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def kv_cache_report(self) -> KVCacheReport:
        """What the engine core sizes the KV cache from (`vx.core.kv_cache_sizing`): this rank's layers' windows, a
        block's bytes over them, and the memory its device has now, with the model loaded."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
        else:
            ram = psutil.virtual_memory()
            free, total = ram.available, ram.total
        runner = self.model_runner
        return KVCacheReport(
            rank=0 if self.groups is None else self.groups.rank,
            pipeline_stage=0 if self.groups is None else self.groups.pp.rank_in_group,
            device=self.device.type, layer_windows=tuple(runner.layer_windows()),
            bytes_per_block=runner.kv_cache_bytes_per_block(), memory_total_bytes=total, memory_free_bytes=free)

    def initialize_kv_cache(self, num_blocks: int, groups: tuple[KVCacheGroupSpec, ...] = ()) -> None:
        self.model_runner.initialize_kv_cache(num_blocks, groups)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        if self.model_runner is not None:
            self.model_runner.shutdown()
        self.model_runner = None
