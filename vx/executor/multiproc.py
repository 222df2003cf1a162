"""MultiprocExecutor: one worker process per rank on this machine, reached over ZMQ.

Each step plan is encoded once (`vx.step.encode_step`) and broadcast on one PUB socket to every worker; every rank
runs the same forward (the tensor-parallel ranks meet in their all-reduces, the pipeline stages pass hidden states
on), and only the output rank (rank 0 of the last stage) answers with the step's `ModelRunnerOutput`. Why a ZMQ
PUB socket rather than a shared-memory ring: one encode and one send a step whatever the world size, no polling
thread, and the same sockets the engine already uses. Measured (`python -m benchmarks.parallel`, 2 cores shared
with other jobs): a step's whole round trip (encode, broadcast, the workers' decode, the reply) costs 0.5-1.5 ms,
1-2% of a step of the `tiny` model (a Ray call per actor: ~3 ms); the all-reduces inside the forward cost far more (see docs/distributed.md).

A worker that dies or raises fails the engine at once: the executor polls every worker's sentinel pipe beside the
reply socket, so `execute_model` raises (and the engine reports `EngineDeadError` to every stream) the moment a
worker exits; `shutdown` then kills the workers still stuck in a collective with the dead one.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time

import zmq

from vx.config import VxConfig, encode_config
from vx.executor.distributed_executor import DistributedExecutor
from vx.executor.worker_process import WorkerProcess
from vx.executor.worker_protocol import STARTUP_SEQ, WorkerCall, WorkerReply, WorkerStartup, encode

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 600.0  # loading a large shard can take minutes
_SHUTDOWN_WAIT_S = 5.0  # a healthy worker's exit after the shutdown call
_LAST_WORDS_S = 0.2  # how long a worker's error may trail its exit on the reply socket


class MultiprocExecutor(DistributedExecutor):
    """A worker process per rank (`tensor_parallel_size x pipeline_parallel_size`), started as
    `python -m vx.executor.worker_main`; broadcast calls, answers from the output rank."""

    def __init__(self, config: VxConfig) -> None:
        super().__init__(config)
        self.workers: list[WorkerProcess] = []
        self._dir = tempfile.mkdtemp(prefix="vx-workers-")
        self._ctx = zmq.Context()
        self._calls = self._ctx.socket(zmq.XPUB)
        self._calls.setsockopt(zmq.XPUB_VERBOSE, 1)  # every worker's subscription arrives, not only the first
        self._calls.setsockopt(zmq.SNDHWM, 0)
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.setsockopt(zmq.RCVHWM, 0)
        for sock in (self._calls, self._replies):  # an interpreter exiting without shutdown() must not hang here
            sock.setsockopt(zmq.LINGER, 0)
        call_addr = f"ipc://{os.path.join(self._dir, 'calls')}"
        reply_addr = f"ipc://{os.path.join(self._dir, 'replies')}"
        try:
            self._calls.bind(call_addr)
            self._replies.bind(reply_addr)
            config_bytes = encode_config(config)
            init_method = f"file://{os.path.join(self._dir, 'rendezvous')}"
            for rank in range(self.world_size):
                self.workers.append(WorkerProcess(WorkerStartup(
                    config=config_bytes, rank=rank, local_rank=rank, init_method=init_method, call_addr=call_addr,
                    reply_addr=reply_addr, sys_path=list(sys.path), sentinel_fd=-1)))
            self._wait_subscriptions()
            self._collect(STARTUP_SEQ, set(range(self.world_size)), timeout_s=_STARTUP_TIMEOUT_S)
        except BaseException:
            self._failed = self._failed or "start-up failed"
            self.shutdown()
            raise
        logger.info("vx: %d worker processes ready (pids %s)", self.world_size, [w.pid for w in self.workers])

    # ------------------------------------------------------------------------------------------ the calls
    def _call(self, method: str, payload: bytes, ranks: set[int]) -> dict[int, tuple[WorkerReply, bytes]]:
        return self._collect(self._broadcast(method, payload), ranks)

    def _broadcast(self, method: str, payload: bytes) -> int:
        self._check_alive()
        self._seq += 1
        self._calls.send_multipart([encode(WorkerCall(seq=self._seq, method=method)), payload], copy=False)
        return self._seq

    def _collect(self, seq: int, ranks: set[int], timeout_s: float | None = None,
                 ) -> dict[int, tuple[WorkerReply, bytes]]:
        """The replies of `ranks` to call `seq`. Raises `WorkerFailedError` as soon as any worker exits or any
        reply carries an error (from whichever rank: a failed rank leaves the others waiting in a collective)."""
        poller = zmq.Poller()
        poller.register(self._replies, zmq.POLLIN)
        for worker in self.workers:
            poller.register(worker.sentinel, zmq.POLLIN)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        got: dict[int, tuple[WorkerReply, bytes]] = {}
        while len(got) < len(ranks):
            wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            events = dict(poller.poll(wait_ms))
            if not events:
                self._fail(f"the workers did not answer within {timeout_s:.0f} s")
            for worker in self.workers:
                if worker.sentinel in events:
                    self._fail_dead(worker)
            if self._replies in events:
                while True:
                    try:
                        header_frame, body = self._replies.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    header = self._reply_decoder.decode(header_frame)
                    if header.error is not None:
                        self._fail_error(header)
                    if header.seq == seq and header.rank in ranks:
                        got[header.rank] = (header, body)
        return got

    def _wait_subscriptions(self) -> None:
        """Wait until every worker's SUB socket has subscribed (XPUB shows each subscription), so that the first
        call reaches them all: a PUB socket drops what it sends before a subscriber is known."""
        poller = zmq.Poller()
        poller.register(self._calls, zmq.POLLIN)
        for worker in self.workers:
            poller.register(worker.sentinel, zmq.POLLIN)
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        subscribed = 0
        while subscribed < self.world_size:
            events = dict(poller.poll(max(0, int((deadline - time.monotonic()) * 1000))))
            if not events:
                self._fail("the workers did not connect in time")
            for worker in self.workers:
                if worker.sentinel in events:
                    self._fail_dead(worker, " while starting")
            if self._calls in events:
                if self._calls.recv()[:1] == b"\x01":
                    subscribed += 1

    def _fail_dead(self, worker: WorkerProcess, when: str = "") -> None:
        """Fail for a worker that exited: with the error it sent before exiting when there is one (a failed start
        sends its traceback, then exits; the exit can be seen first), else with how it ended."""
        deadline = time.monotonic() + _LAST_WORDS_S
        while self._replies.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            header = self._reply_decoder.decode(self._replies.recv_multipart()[0])
            if header.error is not None and header.rank == worker.rank:  # not the others' errors it caused
                self._fail(f"worker rank {header.rank} failed: {header.error}")
        self._fail(f"worker rank {worker.rank} (pid {worker.pid}) {worker.exit_description()}{when}")

    def _fail_error(self, header: WorkerReply) -> None:
        """Fail for a worker's error; when another worker has just died, for that death first: a rank's collective
        fails ("connection closed by peer") because a peer died, and its error can arrive before the death is seen."""
        poller = zmq.Poller()
        for worker in self.workers:
            if worker.rank != header.rank:
                poller.register(worker.sentinel, zmq.POLLIN)
        dead = {fd for fd, _ in poller.poll(int(_LAST_WORDS_S * 1000))}
        for worker in self.workers:
            if worker.sentinel in dead:
                # The whole error follows: at start-up every rank can fail alike, the dead one's words unread.
                self._fail(f"worker rank {worker.rank} (pid {worker.pid}) {worker.exit_description()}; then worker "
                           f"rank {header.rank} failed: {header.error}")
        self._fail(f"worker rank {header.rank} failed: {header.error}")


    # ------------------------------------------------------------------------------------------ the end
    def shutdown(self) -> None:
        """End every worker: a shutdown call and a short wait when they are healthy; at once (SIGKILL) after a
        failure, since the survivors may wait forever in a collective with the dead one. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._failed is None and self.workers:
            try:
                self._calls.send_multipart([encode(WorkerCall(seq=self._seq + 1, method="shutdown")), b""])
            except zmq.ZMQError:
                pass
            deadline = time.monotonic() + _SHUTDOWN_WAIT_S
            for worker in self.workers:
                worker.join(max(0.0, deadline - time.monotonic()))
        for worker in self.workers:
            worker.kill()
        for worker in self.workers:
            worker.join()
            worker.close()
        self._calls.close(linger=0)
        self._replies.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
