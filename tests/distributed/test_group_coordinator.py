"""GroupCoordinator and the parallel groups on torch.distributed (gloo), four processes: TP=2 x PP=2."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from vx.distributed import GroupCoordinator, destroy_parallel_groups, init_parallel_groups


def _rank_main(rank: int, init_method: str) -> None:
    groups = init_parallel_groups(rank, tensor_parallel_size=2, pipeline_parallel_size=2, init_method=init_method)
    try:
        tp, pp = groups.tp, groups.pp
        stage, shard = divmod(rank, 2)
        assert tp.ranks == [2 * stage, 2 * stage + 1] and pp.ranks == [shard, shard + 2]
        assert (tp.rank_in_group, pp.rank_in_group) == (shard, stage)
        # All-reduce sums over the stage's two shards.
        assert tp.all_reduce(torch.tensor([rank + 1.0])).item() == (2 * stage + 1) + (2 * stage + 2)
        # All-gather and gather concatenate in group order; gather only on the first rank.
        assert tp.all_gather(torch.tensor([[rank]]), dim=-1).tolist() == [tp.ranks]
        gathered = tp.gather(torch.tensor([rank * 1.0]), dim=0)
        assert (gathered.tolist() == [float(r) for r in tp.ranks]) if tp.is_first_rank else gathered is None
        assert tp.broadcast(torch.tensor([float(rank)])).item() == tp.ranks[0]
        # A pipeline hop: stage 0 sends its hidden states to stage 1 of the same shard.
        if pp.is_first_rank:
            pp.send(torch.full((2, 3), float(rank)))
        else:
            assert torch.equal(pp.recv((2, 3), torch.float32), torch.full((2, 3), float(pp.prev_rank)))
    finally:
        destroy_parallel_groups()


@pytest.mark.slow
def test_tensor_and_pipeline_groups_of_four_ranks(tmp_path):
    mp.spawn(_rank_main, args=(f"file://{tmp_path / 'rendezvous'}",), nprocs=4, join=True)


def test_a_group_of_one_rank_answers_locally():
    group = GroupCoordinator([0], 0, None)
    x = torch.tensor([3.0])
    assert group.all_reduce(x) is x and group.all_gather(x) is x and group.gather(x) is x
    assert group.is_first_rank and group.is_last_rank and group.next_rank == group.prev_rank == 0
    with pytest.raises(ValueError, match="not in the group"):
        GroupCoordinator([0, 1], 2, None)
    single = init_parallel_groups(0, 1, 1, init_method="unused")
    assert single.tp.world_size == single.pp.world_size == 1 and single.world_size == 1


def _leave_main(rank: int, init_method: str, out_dir: str) -> None:
    import time

    init_parallel_groups(rank, tensor_parallel_size=2, pipeline_parallel_size=1, init_method=init_method)
    ready = f"{out_dir}/rank0_ready"
    if rank == 1:
        # A worker that dies once the groups stand (dying while rank 0 still connects fails its init instead): it
        # never comes to the closing barrier.
        deadline = time.monotonic() + 60
        while not os.path.exists(ready) and time.monotonic() < deadline:
            time.sleep(0.01)
        os._exit(0)
    open(ready, "w").close()
    start = time.monotonic()
    destroy_parallel_groups()
    with open(f"{out_dir}/left_after_s", "w") as f:
        f.write(str(time.monotonic() - start))


@pytest.mark.slow
def test_a_rank_leaves_without_waiting_long_for_a_dead_peer(tmp_path):
    """The closing barrier (which keeps a rank from closing its connections under a peer's last messages) gives up
    on a peer that never comes: shutdown must not hang on a dead worker."""
    mp.spawn(_leave_main, args=(f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2, join=True)
    assert float((tmp_path / "left_after_s").read_text()) < 10
