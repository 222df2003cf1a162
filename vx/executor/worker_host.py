"""One rank's worker and the calls the executors make on it: the code a worker process (`worker_main`) and a Ray
actor (`ray_worker`) share, so that both kinds of executor run the very same worker."""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from vx.class_path import load_class
from vx.executor.worker_protocol import WorkerReply, encode
from vx.kv_spec import KVCacheSize
from vx.module_process import describe_exception

logger = logging.getLogger(__name__)


def worker_class(name: str) -> type:
    """The worker class `ParallelConfig.worker_cls` names: "auto" is vx's `Worker`."""
    from vx.gpu.worker import Worker

    if name == "auto":
        return Worker
    return load_class(name, Worker, "worker_cls", "vx.gpu.worker.Worker")


class WorkerHost:
    """Joins the ranks' process group, builds this rank's worker and loads its shard; then answers calls."""

    def __init__(self, config_bytes: bytes, rank: int, local_rank: int, init_method: str) -> None:
        from vx.config import decode_config
        from vx.distributed import init_parallel_groups

        self.rank = rank
        config = decode_config(config_bytes)
        worker_cls = worker_class(config.parallel_config.worker_cls)
        pc = config.parallel_config
        device = config.device_config.device
        if device == "cuda":  # before NCCL joins: each rank's communicator on its own device
            import torch

            torch.cuda.set_device(local_rank)
        self.groups = init_parallel_groups(rank, pc.tensor_parallel_size, pc.pipeline_parallel_size, init_method,
                                           device=f"cuda:{local_rank}" if device == "cuda" else device)
        self.worker = worker_cls(config, self.groups, local_rank=local_rank)
        self.worker.init_device()
        self.worker.load_model()
        self.is_output_rank = self.worker.model_runner.is_output_rank
        from vx.step import StepDecoder

        self._decoder = StepDecoder()

    def call(self, seq: int, method: str, payload: bytes) -> tuple[WorkerReply, bytes] | None:
        """Run call `seq` (`method` with its payload frame); the reply header and payload, or None when this rank
        does not answer (`execute_model` on a rank other than the output rank). A call that raises answers with
        the error (the executor then fails the engine)."""
        from vx.step import encode_step

        collectives = (self.groups.tp, self.groups.pp)
        t0, comm0 = time.perf_counter(), sum(g.comm_seconds for g in collectives)
        try:
            result = self._dispatch(method, payload, encode_step)
        except BaseException as e:  # noqa: BLE001 - the executor fails the engine with this message
            logger.error("vx worker %d: %s failed: %s", self.rank, method, describe_exception(e))
            return WorkerReply(seq=seq, rank=self.rank, error=describe_exception(e)), b""
        if result is None:
            return None
        return WorkerReply(seq=seq, rank=self.rank, compute_s=time.perf_counter() - t0,
                           comm_s=sum(g.comm_seconds for g in collectives) - comm0), result

    def _dispatch(self, method: str, payload: bytes, encode_step: Any) -> bytes | None:
        worker = self.worker
        if method == "execute_model":
            output = worker.execute_model(self._decoder.scheduler_output(payload))
            return encode_step(output) if self.is_output_rank else None
        if method == "kv_cache_report":
            return encode(worker.kv_cache_report())
        if method == "initialize_kv_cache":
            kv_cache = msgspec.msgpack.decode(payload, type=KVCacheSize)
            worker.initialize_kv_cache(kv_cache.num_blocks, kv_cache.groups)
            return b""
        raise ValueError(f"unknown worker call {method!r}")

    def shutdown(self) -> None:
        """Stop the worker and leave the process group."""
        from vx.distributed import destroy_parallel_groups

        self.worker.shutdown()
        destroy_parallel_groups()
