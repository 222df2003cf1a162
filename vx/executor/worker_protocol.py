"""What crosses between the multiprocess executor and its worker processes: msgspec Structs, msgpack, no pickle.

- The startup message, on the worker's stdin (length-prefixed), which then stays open: end-of-file there tells the
  worker that the engine is gone.
- Each call, broadcast to every worker on one ZMQ PUB socket: two frames, [`WorkerCall` header, payload]. The
  payload of `execute_model` is the step plan as `vx.step.encode_step` writes it, encoded once for all workers.
- Each reply, on one PUSH socket per worker to the executor's PULL: [`WorkerReply` header, payload].
"""

from __future__ import annotations

from typing import BinaryIO

import msgspec

from vx.module_process import frame_startup, read_startup_body


class WorkerStartup(msgspec.Struct, array_like=True, kw_only=True):
    """What a worker process needs before anything else: its place in the world and where to reach the executor."""

    config: bytes  # the engine's VxConfig (`encode_config`), as the engine got it
    rank: int  # global rank: stage * tensor_parallel_size + tensor-parallel rank
    local_rank: int  # its device on this machine (cuda:local_rank)
    init_method: str  # torch.distributed rendezvous (file:// or tcp://)
    call_addr: str  # the executor's PUB socket (calls)
    reply_addr: str  # the executor's PULL socket (replies)
    sys_path: list[str]  # the engine's import path
    sentinel_fd: int  # the pipe end this worker holds open until it exits: the executor's death notice


class WorkerCall(msgspec.Struct, array_like=True, kw_only=True):
    """One call to every worker: `method` with the payload frame as its argument; `seq` numbers the calls."""

    seq: int
    method: str


class WorkerReply(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """A worker's answer to call `seq` (or to its start-up: seq -1); `error` set when the call raised.

    `compute_s` is the call's wall time in the worker, `comm_s` the part of it spent inside collectives and stage
    transfers (waiting for the other ranks included): the communication share of a step."""

    seq: int
    rank: int
    error: str | None = None
    compute_s: float = 0.0
    comm_s: float = 0.0


STARTUP_SEQ = -1  # the seq of the reply a worker sends once its model is loaded (or failed to load)

_ENCODER = msgspec.msgpack.Encoder()


def encode(obj: object) -> bytes:
    return _ENCODER.encode(obj)


def encode_startup(startup: WorkerStartup) -> bytes:
    """The startup message as it goes on the worker's stdin (vx.module_process.frame_startup)."""
    return frame_startup(_ENCODER.encode(startup))


def read_startup(stream: BinaryIO) -> WorkerStartup:
    """Read exactly one `encode_startup` message from `stream` (the pipe stays open after it)."""
    return msgspec.msgpack.decode(read_startup_body(stream, "the worker's stdin"), type=WorkerStartup)
