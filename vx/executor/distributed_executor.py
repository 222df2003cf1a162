"""What the executors of several ranks share (`MultiprocExecutor`, `RayExecutor`): the calls every rank answers, the
step that only the output rank answers, the per-step timings, and failing for good once a worker fails.

A kind of executor says how it reaches its workers by implementing `_call` (send a call to every rank, return the
answers of the ranks asked for, raise `WorkerFailedError` as soon as any worker dies or raises).
"""

from __future__ import annotations

import time
from abc import abstractmethod
from dataclasses import dataclass

import msgspec

from vx.config import VxConfig
from vx.executor.abstract import Executor
from vx.executor.worker_protocol import WorkerReply, encode
from vx.kv_spec import KVCacheReport, KVCacheSize
from vx.step import ModelRunnerOutput, SchedulerOutput, StepDecoder, encode_step


class WorkerFailedError(RuntimeError):
    """A worker died or its call raised: the engine cannot go on."""


@dataclass
class ExecutorStepStats:
    """Cumulative timings of `execute_model` calls that computed tokens: the executor's wall time, the output
    rank's own time in the call, and the part of that spent in collectives and stage transfers."""

    steps: int = 0
    wall_s: float = 0.0
    worker_s: float = 0.0
    comm_s: float = 0.0

    @property
    def round_trip_s(self) -> float:
        """Broadcast, decode, reply: what the executor adds around the workers' compute."""
        return self.wall_s - self.worker_s


class DistributedExecutor(Executor):
    """Ranks `tensor_parallel_size x pipeline_parallel_size`, every one called each time; rank 0 of the last
    pipeline stage (`output_rank`) answers the steps."""

    def __init__(self, config: VxConfig) -> None:
        super().__init__(config)
        pc = config.parallel_config
        self.world_size = pc.world_size
        self.output_rank = (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size
        self.stats = ExecutorStepStats()
        self._failed: str | None = None
        self._closed = False
        self._seq = 0
        self._decoder = StepDecoder()
        self._reply_decoder = msgspec.msgpack.Decoder(WorkerReply)

    @abstractmethod
    def _call(self, method: str, payload: bytes, ranks: set[int]) -> dict[int, tuple[WorkerReply, bytes]]:
        """Call `method` on every rank; the replies of `ranks`. Raises `WorkerFailedError` when any worker fails."""

    def _call_all(self, method: str, payload: bytes = b"") -> dict[int, bytes]:
        """Call `method` on every rank; rank -> its reply's payload."""
        return {rank: body for rank, (_, body) in self._call(method, payload, set(range(self.world_size))).items()}

    def _check_alive(self) -> None:
        if self._failed is not None:
            raise WorkerFailedError(f"the workers failed earlier: {self._failed}")

    def _fail(self, reason: str) -> None:
        self._failed = reason
        raise WorkerFailedError(reason)

    def kv_cache_reports(self) -> list[KVCacheReport]:
        replies = self._call_all("kv_cache_report")
        return [msgspec.msgpack.decode(replies[rank], type=KVCacheReport) for rank in sorted(replies)]

    def initialize_kv_cache(self, kv_cache: KVCacheSize) -> None:
        self._call_all("initialize_kv_cache", encode(kv_cache))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        header, payload = self._call("execute_model", encode_step(scheduler_output), {self.output_rank})[
            self.output_rank]
        output = self._decoder.model_runner_output(payload)
        if scheduler_output.total_num_scheduled_tokens:
            self.stats.steps += 1
            self.stats.wall_s += time.perf_counter() - t0
            self.stats.worker_s += header.compute_s
            self.stats.comm_s += header.comm_s
        return output
