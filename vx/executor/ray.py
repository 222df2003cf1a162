"""RayExecutor: the ranks as Ray actors in a placement group, running the same worker code as the worker processes.

The engine joins the Ray cluster its process is connected to (`ray.init(...)` called by the application, for an
engine in the application's process), else the one `RAY_ADDRESS` names (Ray's own variable), else starts a local
one (and stops it at shutdown). One bundle per rank (a CPU; a GPU and a CPU on CUDA), packed onto as few nodes as
possible; rank 0's node and a free port there are the process group's rendezvous (tcp://). Every call goes to
every actor (Ray keeps one caller's calls to an actor in order); the executor waits for the ranks that answer and
watches the others' calls, so that an actor that dies (Ray raises `RayActorError`) or a call that raises fails the
engine at once. Actors are owned by the engine: if its process dies, Ray ends them.
"""

from __future__ import annotations

import logging

from vx.config import VxConfig, encode_config
from vx.executor.distributed_executor import DistributedExecutor
from vx.executor.ray_worker import RayWorker
from vx.executor.worker_protocol import WorkerReply

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 120.0  # a cluster without the resources for every rank never places the group
_LAST_WORDS_S = 0.2  # how long an actor's death may trail the error it causes in another rank


class RayExecutor(DistributedExecutor):
    """A Ray actor per rank (`tensor_parallel_size x pipeline_parallel_size`); calls to all, answers from the
    output rank."""

    def __init__(self, config: VxConfig) -> None:
        super().__init__(config)
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.actors: list = []
        self.actor_pids: list[int] = []
        self._pg = None
        self._pending: dict = {}  # ref -> rank: calls whose answers nobody waits for (yet)
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(include_dashboard=False, logging_level=logging.WARNING)
        try:
            cuda = config.device_config.device == "cuda"
            bundle = {"CPU": 1.0, "GPU": 1.0} if cuda else {"CPU": 1.0}
            self._pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
            ready, _ = ray.wait([self._pg.ready()], timeout=_PLACEMENT_TIMEOUT_S)
            if not ready:
                self._fail(f"the Ray cluster did not place {self.world_size} workers of {bundle} within "
                           f"{_PLACEMENT_TIMEOUT_S:.0f} s (its resources: {ray.cluster_resources()})")
            remote_worker = ray.remote(RayWorker)
            for rank in range(self.world_size):
                self.actors.append(remote_worker.options(
                    num_cpus=1, num_gpus=1 if cuda else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self._pg, placement_group_bundle_index=rank)).remote())
            self.actor_pids = ray.get([actor.pid.remote() for actor in self.actors])
            ip, port = ray.get(self.actors[0].node_address.remote())
            config_bytes = encode_config(config)
            # Ray shows each actor only its own GPU: every rank's device is cuda:0 in its process.
            refs = {actor.start.remote(config_bytes, rank, 0, f"tcp://{ip}:{port}"): rank
                    for rank, actor in enumerate(self.actors)}
            self._collect(refs, set(range(self.world_size)))
        except BaseException:
            self._failed = self._failed or "start-up failed"
            self.shutdown()
            raise
        logger.info("vx: %d Ray workers ready (pids %s)", self.world_size, self.actor_pids)

    # ------------------------------------------------------------------------------------------ the calls
    def _call(self, method: str, payload: bytes, ranks: set[int]) -> dict[int, tuple[WorkerReply, bytes]]:
        """Call `method` on every actor; the answers of `ranks` (the others' calls are watched from here on)."""
        self._check_alive()
        self._seq += 1
        refs = {actor.call.remote(self._seq, method, payload): rank for rank, actor in enumerate(self.actors)}
        return self._collect(refs, ranks)

    def _collect(self, refs: dict, ranks: set[int]) -> dict[int, tuple[WorkerReply, bytes]]:
        """The answers of `ranks` among `refs`; raises `WorkerFailedError` as soon as any call (these, or one
        watched from before) raises or its actor dies."""
        import ray

        wanted = {ref: rank for ref, rank in refs.items() if rank in ranks}
        self._pending.update({ref: rank for ref, rank in refs.items() if rank not in ranks})
        waiting = list(wanted) + list(self._pending)
        got: dict[int, tuple[WorkerReply, bytes]] = {}
        while len(got) < len(wanted):
            ready, waiting = ray.wait(waiting, num_returns=1)
            for ref in ready:
                rank = wanted.get(ref, self._pending.pop(ref, None))
                try:
                    answer = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - RayActorError (died), RayTaskError, ...
                    self._fail(f"Ray worker rank {rank} failed: {type(e).__name__}: {e}")
                if answer is None:
                    continue
                header = self._reply_decoder.decode(answer[0])
                if header.error is not None:
                    self._fail_error(header, {ref: wanted.get(ref, self._pending.get(ref)) for ref in waiting})
                if ref in wanted:
                    got[rank] = (header, answer[1])
        return got

    def _fail_error(self, header: WorkerReply, others: dict) -> None:
        """Fail for a rank's error; when another rank's actor has just died, for that death first (the error is
        often its consequence: a collective whose peer is gone)."""
        import ray

        if others:
            ready, _ = ray.wait(list(others), num_returns=len(others), timeout=_LAST_WORDS_S)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as e:  # noqa: BLE001 - the death that came first
                    self._fail(f"Ray worker rank {others[ref]} failed: {type(e).__name__}: {e}; then worker rank "
                               f"{header.rank} failed: {header.error}")
        self._fail(f"worker rank {header.rank} failed: {header.error}")


    # ------------------------------------------------------------------------------------------ the end
    def shutdown(self) -> None:
        """End every actor (a shutdown call first when they are healthy), remove the placement group, and stop the
        local Ray instance this executor started. Idempotent."""
        if self._closed:
            return
        self._closed = True
        import ray
        from ray.util.placement_group import remove_placement_group

        if self._failed is None and self.actors:
            try:
                ray.get([actor.shutdown.remote() for actor in self.actors], timeout=5.0)
            except Exception:  # noqa: BLE001 - they are killed below anyway
                logger.warning("vx: Ray workers did not shut down cleanly; killing them")
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self._pg is not None:
            remove_placement_group(self._pg)
        if self._started_ray:
            ray.shutdown()
