"""A worker owns one device: it sets it up, sizes the KV cache, and runs its ModelRunner."""

from __future__ import annotations

import logging

import msgspec
import psutil
import torch

from vx.cache.block_table_group import KVCacheGroupSpec
from vx.cache.kv_cache_size import KVCacheSize, cpu_kv_cap_bytes, kv_cache_groups, size_kv_cache
from vx.config import VxConfig
from vx.gpu.model_runner import ModelRunner
from vx.step import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class Worker:
    """Device set-up, KV cache sizing and model execution for one device."""

    def __init__(self, config: VxConfig) -> None:
        self.config = config
        device = torch.device(config.device_config.device)
        if device.type == "cuda" and device.index is None:
            # torch.cuda.set_device needs an index: "cuda" means the current device, as torch reads it.
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        torch.manual_seed(self.config.model_config.seed)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        threads = self.config.device_config.cpu_threads
        if self.device.type == "cpu" and threads and torch.get_num_threads() != threads:
            # Before the model loads: the C kernels' OpenMP loops take torch's count at each call.
            torch.set_num_threads(threads)
        self.model_runner = ModelRunner(self.config, self.device)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_kv_cache_size(self) -> KVCacheSize:
        """The KV cache's blocks and why (`vx.cache.kv_cache_size.size_kv_cache` holds the rule); this measures what
        it needs: a block's bytes, and the memory the device offers when the user set no size."""
        cc = self.config.cache_config
        budget = 0
        if cc.num_kv_blocks is None and cc.kv_cache_memory_bytes is None:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                budget = int(total * cc.gpu_memory_utilization) - (total - free) - 512 * 1024**2
            else:
                budget = cpu_kv_cap_bytes(psutil.virtual_memory().available)
        sc = self.config.scheduler_config
        size = size_kv_cache(
            device=self.device.type, block_size=cc.block_size,
            bytes_per_block=self.model_runner.kv_cache_bytes_per_block(),
            max_model_len=self.config.model_config.max_model_len,
            max_num_seqs=sc.max_num_seqs, num_kv_blocks=cc.num_kv_blocks,
            kv_cache_memory_bytes=cc.kv_cache_memory_bytes, device_budget_bytes=budget)
        # Sliding-window layers get pools of their own, which hold only their windows.
        groups = kv_cache_groups(self.model_runner.layer_windows(), size.num_blocks, cc.block_size,
                                 sc.max_num_seqs, sc.max_num_batched_tokens, rebalance=size.source != "num_kv_blocks")
        return msgspec.structs.replace(size, groups=groups)

    def initialize_kv_cache(self, num_blocks: int, groups: tuple[KVCacheGroupSpec, ...] = ()) -> None:
        self.model_runner.initialize_kv_cache(num_blocks, groups)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        if self.model_runner is not None:
            self.model_runner.shutdown()
        self.model_runner = None
