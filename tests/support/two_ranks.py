"""Two tensor-parallel ranks (gloo) started once for a whole list of jobs: each start of a rank imports torch and vx
and joins a group (seconds), so tests that compare many models split over two ranks share one start."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp

from vx.distributed import destroy_parallel_groups, init_parallel_groups

RankJob = Callable[[Any, Any], dict]
"""`job(spec, tp_group)`: what one rank found for one spec, as JSON (a module-level function: the ranks import it)."""


def run_on_two_ranks(job: RankJob, specs: dict[str, Any], out_dir: Path) -> tuple[dict[str, list[dict]], str | None]:
    """`job` on both ranks for every spec, in order: {name: [rank 0's result, rank 1's]} for the specs both ranks
    finished, and the error that stopped the ranks (then the later specs have no results), else None."""
    error = None
    try:
        mp.spawn(_rank_main, args=(job, specs, f"file://{out_dir / 'rendezvous'}", str(out_dir)), nprocs=2,
                 join=True)
    except Exception as e:  # noqa: BLE001 - reported by each test whose spec it stopped
        said = sorted(out_dir.glob("error-rank*.txt"))
        error = "\n".join(f.read_text() for f in said) if said else f"{type(e).__name__}: {e}"
    results = {}
    for i, name in enumerate(specs):
        files = [out_dir / f"{i}-rank{rank}.json" for rank in range(2)]
        if all(f.exists() for f in files):
            results[name] = [json.loads(f.read_text()) for f in files]
    return results, error


def _rank_main(rank: int, job: RankJob, specs: dict[str, Any], init_method: str, out_dir: str) -> None:
    groups = init_parallel_groups(rank, tensor_parallel_size=2, pipeline_parallel_size=1, init_method=init_method)
    for i, (name, spec) in enumerate(specs.items()):
        try:
            result = job(spec, groups.tp)
        except BaseException:
            Path(out_dir, f"error-rank{rank}.txt").write_text(f"rank {rank}, {name}: {traceback.format_exc()}")
            # At once, without leaving the group: a peer waiting in a collective for this rank would wait as long
            # as gloo lets it, where mp.spawn ends it as soon as this process is gone.
            os._exit(1)
        with open(f"{out_dir}/{i}-rank{rank}.json", "w") as f:
            json.dump(result, f)
    destroy_parallel_groups()
