"""A worker owns one device: it sets it up, sizes the KV cache, and runs its ModelRunner."""

from __future__ import annotations

import logging

import msgspec
import psutil
import torch

from vx.cache.block_table_group import KVCacheGroupSpec
from vx.cache.kv_cache_size import KVCacheSize, cpu_kv_cap_bytes, kv_cache_groups, size_kv_cache
from vx.config import VxConfig
from vx.distributed import ParallelGroups
from vx.gpu.model_runner import ModelRunner
from vx.step import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class Worker:
    """Device set-up, KV cache sizing and model execution for one device: the whole model, or one rank's part of it
    (`groups`: its tensor-parallel shard of its pipeline stage)."""

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
        self.model_runner = ModelRunner(self.config, self.device, self.groups)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def layer_windows(self) -> list[int | None]:
        """This worker's attention layers' sliding windows (None: full attention), in layer order."""
        return self.model_runner.layer_windows()

    def determine_kv_cache_size(self, layer_windows: list[int | None] | None = None) -> KVCacheSize:
        """The KV cache's blocks and why (`vx.cache.kv_cache_size.size_kv_cache` holds the rule); this measures what
        it needs: a block's bytes, and the memory the device offers when the user set no size.

        `layer_windows`: every layer's window over all pipeline stages (default: this worker's), so that every
        stage makes the same KV-cache groups; with several stages the groups are not rebalanced (a stage may hold
        only one kind of layer, so memory moved between kinds could overrun its budget)."""
        cc = self.config.cache_config
        budget = 0
        if cc.num_kv_blocks is None and cc.kv_cache_memory_bytes is None:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                budget = int(total * cc.gpu_memory_utilization) - (total - free) - 512 * 1024**2
            else:
                # The workers of one machine share its RAM: each takes its share of the cap.
                budget = cpu_kv_cap_bytes(psutil.virtual_memory().available) // self.config.parallel_config.world_size
        sc = self.config.scheduler_config
        size = size_kv_cache(
            device=self.device.type, block_size=cc.block_size,
            bytes_per_block=self.model_runner.kv_cache_bytes_per_block(),
            max_model_len=self.config.model_config.max_model_len,
            max_num_seqs=sc.max_num_seqs, num_kv_blocks=cc.num_kv_blocks,
            kv_cache_memory_bytes=cc.kv_cache_memory_bytes, device_budget_bytes=budget)
        # Sliding-window layers get pools of their own, which hold only their windows.
        windows = self.model_runner.layer_windows() if layer_windows is None else layer_windows
        rebalance = size.source != "num_kv_blocks" and self.config.parallel_config.pipeline_parallel_size == 1
        groups = kv_cache_groups(windows, size.num_blocks, cc.block_size, sc.max_num_seqs,
                                 sc.max_num_batched_tokens, rebalance=rebalance)
        return msgspec.structs.replace(size, groups=groups)

    def initialize_kv_cache(self, num_blocks: int, groups: tuple[KVCacheGroupSpec, ...] = ()) -> None:
        self.model_runner.initialize_kv_cache(num_blocks, groups)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        if self.model_runner is not None:
            self.model_runner.shutdown()
        self.model_runner = None
