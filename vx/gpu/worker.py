"""A worker owns one device: it sets it up, sizes the KV cache, and runs its ModelRunner."""

from __future__ import annotations

import logging

import psutil
import torch

from vx.config import VxConfig
from vx.gpu.model_runner import ModelRunner
from vx.step import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# On CPU the KV cache shares RAM with everything else: take at most this much by default.
_CPU_DEFAULT_KV_BYTES = 4 * 1024**3
_CPU_MAX_FRACTION = 0.25


class Worker:
    """Device set-up, KV cache sizing and model execution for one device."""

    def __init__(self, config: VxConfig) -> None:
        self.config = config
        self.device = torch.device(config.device_config.device)
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        torch.manual_seed(self.config.model_config.seed)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model_runner = ModelRunner(self.config, self.device)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_kv_blocks(self) -> int:
        """Blocks from `num_kv_blocks`, else from the memory budget; never more than can be used."""
        cc = self.config.cache_config
        sc = self.config.scheduler_config
        max_model_len = self.config.model_config.max_model_len
        per_block = self.model_runner.kv_cache_bytes_per_block()
        # One spare block: block 0 is reserved as the padding block.
        useful = sc.max_num_seqs * -(-max_model_len // cc.block_size) + 1
        if cc.num_kv_blocks is not None:
            return cc.num_kv_blocks
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * cc.gpu_memory_utilization) - used - 512 * 1024**2
        else:
            budget = min(_CPU_DEFAULT_KV_BYTES, int(psutil.virtual_memory().available * _CPU_MAX_FRACTION))
        num = min(budget // per_block, useful)
        need = -(-max_model_len // cc.block_size) + 1
        if num < need:
            raise ValueError(
                f"The KV cache budget ({budget / 2**20:.0f} MiB) holds {num} blocks, fewer than one "
                f"sequence of max_model_len={max_model_len} needs ({need}); lower max_model_len or "
                "raise the memory budget.")
        return int(num)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        if self.model_runner is not None:
            self.model_runner.shutdown()
        self.model_runner = None
