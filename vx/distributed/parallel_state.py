"""The tensor- and pipeline-parallel groups of one process, made once when its worker starts and torn down with it.

Ranks are laid out stage by stage: world size = pipeline stages x tensor-parallel ranks, and global rank
r = stage * tp + tp_rank. A tensor-parallel group is one stage's ranks; a pipeline group is the ranks holding the
same shard in every stage. Nothing here is global: the worker keeps the `ParallelGroups` it gets and hands the
groups to the model's layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from vx.distributed.group_coordinator import GroupCoordinator, backend_for


@dataclass
class ParallelGroups:
    """This process's groups: `tp` (the ranks sharding its layers), `pp` (the stages it passes hidden states
    along)."""

    tp: GroupCoordinator
    pp: GroupCoordinator
    world_size: int
    rank: int


def init_parallel_groups(rank: int, tensor_parallel_size: int, pipeline_parallel_size: int,
                         init_method: str, device: torch.device | str = "cpu") -> ParallelGroups:
    """Join the process group (`init_method`: a `tcp://` or `file://` rendezvous) and make this rank's groups.

    Every rank of the world calls it with the same sizes; torch.distributed needs every group made on every rank,
    in the same order, so all of them are made here and each rank keeps its own.
    """
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if tp < 1 or pp < 1:
        raise ValueError(f"tensor_parallel_size={tp} and pipeline_parallel_size={pp} must be >= 1.")
    world = tp * pp
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world} ranks.")
    backend = backend_for(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, world_size=world, rank=rank)
    tp_groups = [list(range(stage * tp, (stage + 1) * tp)) for stage in range(pp)]
    pp_groups = [list(range(shard, world, tp)) for shard in range(tp)]

    def make(all_ranks: list[list[int]]) -> GroupCoordinator:
        mine = None
        for ranks in all_ranks:
            group = dist.new_group(ranks, backend=backend) if world > 1 and len(ranks) > 1 else None
            if rank in ranks:
                mine = GroupCoordinator(ranks, rank, group)
        assert mine is not None
        return mine

    return ParallelGroups(tp=make(tp_groups), pp=make(pp_groups), world_size=world, rank=rank)


# How long a leaving rank waits for its peers at the closing barrier: every rank leaves at once (a shutdown call
# broadcast to all of them), and a peer that never comes (it died) must not hold the others' exit for long.
LEAVE_BARRIER_TIMEOUT = timedelta(seconds=2)


def destroy_parallel_groups() -> None:
    """Leave the process group (idempotent): every group made with it ends.

    Over gloo the ranks first meet at a barrier (at most `LEAVE_BARRIER_TIMEOUT`): a rank that closed its connections
    while a peer's last messages were still in flight to it could abort the process (a rare SIGABRT, "terminate
    called without an active exception", seen in a two-rank test)."""
    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1 and dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=LEAVE_BARRIER_TIMEOUT)
        except RuntimeError:  # a peer gone or late: leave anyway
            pass
    dist.destroy_process_group()


def pp_layer_range(num_layers: int, stage: int, num_stages: int) -> tuple[int, int]:
    """The layers [start, end) of pipeline stage `stage`: an even split, the earlier stages taking one more each
    when it does not divide (the last stage also computes the LM head)."""
    if not 0 < num_stages <= num_layers:
        raise ValueError(f"{num_stages} pipeline stages cannot split {num_layers} layers (each stage needs one).")
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return start, start + base + (1 if stage < extra else 0)
