"""The Ray actor of one rank: `WorkerHost`, the worker code a worker process runs too, behind Ray method calls.

A plain class, made an actor by `RayExecutor` (`ray.remote(RayWorker)`), so that this module imports no Ray and
the actor's process imports torch only when it starts its rank.
"""

from __future__ import annotations

import os
import socket

from vx.executor.worker_protocol import WorkerReply, encode


class RayWorker:
    """One rank as a Ray actor: `start` builds its `WorkerHost`, `call` answers the executor's calls."""

    def __init__(self) -> None:
        self.host = None

    def node_address(self) -> tuple[str, int]:
        """This node's IP and a free port on it: rank 0's answer is the rendezvous of the process group."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def pid(self) -> int:
        return os.getpid()

    def start(self, config_bytes: bytes, rank: int, local_rank: int, init_method: str) -> tuple[bytes, bytes]:
        """Join the ranks' process group and load this rank's shard; the start-up reply."""
        from vx import platform
        from vx.executor.worker_host import WorkerHost
        from vx.module_process import describe_exception
        from vx.executor.worker_protocol import STARTUP_SEQ

        platform.prefer_openmp_wait_policy()  # before torch is imported
        try:
            self.host = WorkerHost(config_bytes, rank, local_rank, init_method)
        except BaseException as e:  # noqa: BLE001 - the executor reports it as the engine's start-up failure
            return encode(WorkerReply(seq=STARTUP_SEQ, rank=rank, error=describe_exception(e))), b""
        return encode(WorkerReply(seq=STARTUP_SEQ, rank=rank)), b""

    def call(self, seq: int, method: str, payload: bytes) -> tuple[bytes, bytes] | None:
        """The reply (header, payload) to call `seq`, or None when this rank does not answer it."""
        answer = self.host.call(seq, method, payload)
        return None if answer is None else (encode(answer[0]), answer[1])

    def shutdown(self) -> None:
        if self.host is not None:
            self.host.shutdown()
            self.host = None
