"""The engine core's one decision on the KV cache: every worker's report in, one size for all ranks out.

Workers only measure (`vx.kv_spec.KVCacheReport`); the rules that turn a block's bytes and a device's memory into
blocks are `vx.cache.kv_cache_size`'s. Deciding here, once, gives every rank the same number of blocks and, with
pipeline stages, the same KV-cache groups from the whole model's layers, which no single stage holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from vx.cache.kv_cache_size import cpu_kv_cap_bytes, kv_cache_groups, size_kv_cache
from vx.config import VxConfig
from vx.kv_spec import KVCacheReport, KVCacheSize

# What CUDA's default keeps free beyond the model and the cache: a step's activations and workspace need room too.
CUDA_RESERVED_BYTES = 512 * 1024**2


def kv_cache_budget_bytes(config: VxConfig, report: KVCacheReport) -> int:
    """The memory one worker's device offers the KV cache when the user set no size; 0 when they did.

    CUDA: `gpu_memory_utilization` of the device, less what is in use already (the model) and a reserve. CPU: the
    CPU's cap on the RAM available now, shared by the workers of the machine.
    """
    cc = config.cache_config
    if cc.num_kv_blocks is not None or cc.kv_cache_memory_bytes is not None:
        return 0
    if report.device == "cuda":
        total, free = report.memory_total_bytes, report.memory_free_bytes
        return int(total * cc.gpu_memory_utilization) - (total - free) - CUDA_RESERVED_BYTES
    return cpu_kv_cap_bytes(report.memory_free_bytes) // config.parallel_config.world_size


def model_layer_windows(reports: Sequence[KVCacheReport]) -> list[int | None]:
    """Every attention layer's window over the whole model: each pipeline stage's layers once (the report of its
    lowest rank; its tensor-parallel peers hold the same layers), in stage order."""
    by_stage: dict[int, tuple[int | None, ...]] = {}
    for report in sorted(reports, key=lambda r: r.rank):
        by_stage.setdefault(report.pipeline_stage, report.layer_windows)
    return [window for stage in sorted(by_stage) for window in by_stage[stage]]


def decide_kv_cache_size(config: VxConfig, reports: Sequence[KVCacheReport]) -> KVCacheSize:
    """The KV cache every rank allocates: each rank's size by `size_kv_cache`, the smallest of them (a rank with less
    memory, or a pipeline stage with more layers, bounds them all), split into groups per attention kind.

    With several pipeline stages the groups are not rebalanced: a stage may hold only one kind of layer, so memory
    moved between kinds could overrun its budget. Raises ValueError when a rank's budget cannot hold one
    `max_model_len` sequence.
    """
    if not reports:
        raise ValueError("no worker reported its KV cache: the executor started no worker")
    cc, sc = config.cache_config, config.scheduler_config
    sizes = [size_kv_cache(device=report.device, block_size=cc.block_size, bytes_per_block=report.bytes_per_block,
                           max_model_len=config.model_config.max_model_len, max_num_seqs=sc.max_num_seqs,
                           num_kv_blocks=cc.num_kv_blocks, kv_cache_memory_bytes=cc.kv_cache_memory_bytes,
                           device_budget_bytes=kv_cache_budget_bytes(config, report))
             for report in sorted(reports, key=lambda r: r.rank)]
    size = min(sizes, key=lambda s: s.num_blocks)
    # Sliding-window layers get pools of their own, which hold only their windows.
    rebalance = size.source != "num_kv_blocks" and config.parallel_config.pipeline_parallel_size == 1
    groups = kv_cache_groups(model_layer_windows(reports), size.num_blocks, cc.block_size, sc.max_num_seqs,
                             sc.max_num_batched_tokens, rebalance=rebalance)
    return msgspec.structs.replace(size, groups=groups)
