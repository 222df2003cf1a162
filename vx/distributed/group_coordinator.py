"""One parallel group of ranks (tensor- or pipeline-parallel) and the collectives a sharded model needs on it.

Built on `torch.distributed`: gloo on the CPU, NCCL on CUDA (`backend_for`). A group of one rank answers every
collective locally without touching torch.distributed, so the single-device path pays nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist


def backend_for(device: torch.device | str) -> str:
    """The collective backend for a device: NCCL for CUDA, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class GroupCoordinator:
    """The ranks of one group, this process's place in it, and its collectives (sum all-reduce, all-gather, gather
    to the first rank, broadcast, point-to-point send/recv)."""

    def __init__(self, ranks: list[int], rank: int, group: dist.ProcessGroup | None) -> None:
        """`ranks`: the global ranks of the group, in group order; `rank`: this process's global rank (one of them);
        `group`: its torch.distributed group (None for a group of one rank)."""
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not in the group {ranks}.")
        self.ranks = list(ranks)
        self.rank = rank
        self.rank_in_group = self.ranks.index(rank)
        self.world_size = len(self.ranks)
        self.group = group
        # Seconds this process has spent inside the group's collectives (waiting for the other ranks included):
        # the communication share of a step, which the workers report (benchmarks/parallel.py).
        self.comm_seconds = 0.0

    @contextmanager
    def _timed(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.comm_seconds += time.perf_counter() - t0

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """The global rank after this one in the group (wrapping): where a pipeline stage sends its output."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        """The global rank before this one in the group (wrapping): where a pipeline stage's input comes from."""
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the group's ranks (in place; returned)."""
        if self.world_size > 1:
            with self._timed():
                dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in group order, on every rank."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        with self._timed():
            dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Every rank's `x` concatenated along `dim` on the group's first rank (the one that samples); None on the
        others."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_first_rank else None
        with self._timed():
            dist.gather(x.contiguous(), parts, dst=self.ranks[0], group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, x: torch.Tensor, src_in_group: int = 0) -> torch.Tensor:
        """`x` as the group's rank `src_in_group` holds it, on every rank (in place; returned)."""
        if self.world_size > 1:
            with self._timed():
                dist.broadcast(x, src=self.ranks[src_in_group], group=self.group)
        return x

    def send(self, x: torch.Tensor, dst: int | None = None) -> None:
        """Send `x` to the global rank `dst` (default: the next rank), e.g. hidden states to the next stage."""
        with self._timed():
            dist.send(x.contiguous(), dst=self.next_rank if dst is None else dst, group=self.group)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int | None = None,
             device: torch.device | str = "cpu") -> torch.Tensor:
        """A tensor of `shape` and `dtype` from the global rank `src` (default: the previous rank)."""
        x = torch.empty(shape, dtype=dtype, device=device)
        with self._timed():
            dist.recv(x, src=self.prev_rank if src is None else src, group=self.group)
        return x
