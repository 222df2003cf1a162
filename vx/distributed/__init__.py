"""Process groups for tensor- and pipeline-parallel ranks on torch.distributed (gloo on the CPU, NCCL on CUDA)."""

from vx.distributed.group_coordinator import GroupCoordinator, backend_for
from vx.distributed.parallel_state import (ParallelGroups, destroy_parallel_groups, init_parallel_groups,
                                           pp_layer_range)

__all__ = ["GroupCoordinator", "ParallelGroups", "backend_for", "destroy_parallel_groups", "init_parallel_groups",
           "pp_layer_range"]
