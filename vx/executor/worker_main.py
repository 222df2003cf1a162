"""A worker process's entry point, run as `python -m vx.executor.worker_main` by `vx.executor.worker_process`.

Started as its own module (never as a multiprocessing target), so it never re-imports the application's main
module. Its stdin is a pipe from the engine: first the `WorkerStartup` message, then nothing; end-of-file there (or
a new parent) means the engine is gone, and the worker exits at once, even in the middle of a collective.

It joins the process group of its rank, loads its shard, answers the start-up, then serves the executor's calls
(each broadcast to every worker) until `shutdown`.
"""

from __future__ import annotations

import importlib
import logging
import os
import select
import signal
import sys
import threading
import time
import traceback

# Ctrl-C belongs to the application, which shuts the engine (and so the workers) down.
signal.signal(signal.SIGINT, signal.SIG_IGN)

import msgspec  # noqa: E402
import zmq  # noqa: E402

from vx import platform  # noqa: E402
from vx.executor.worker_protocol import (  # noqa: E402
    STARTUP_SEQ,
    InitKVCache,
    WorkerCall,
    WorkerReply,
    encode,
    read_startup,
)

logger = logging.getLogger("vx.executor.worker_main")  # `__name__` is "__main__" here

_PARENT_POLL_S = 1.0  # how often the watchdog checks that the engine is still the parent


def main() -> None:
    """Read the startup message, watch the engine, join the world, load, serve (never returns)."""
    stdin = sys.stdin.buffer
    startup = read_startup(stdin)
    os.set_inheritable(startup.sentinel_fd, False)  # held by this process alone, so its exit closes it
    sys.path[:] = startup.sys_path
    watch_parent(stdin.fileno())
    platform.prefer_passive_openmp_wait()  # before torch is imported
    ctx = zmq.Context()
    calls = ctx.socket(zmq.SUB)
    calls.setsockopt(zmq.RCVHWM, 0)
    calls.setsockopt(zmq.SUBSCRIBE, b"")
    calls.connect(startup.call_addr)  # first: the executor waits for every subscription before its first call
    replies = ctx.socket(zmq.PUSH)
    replies.setsockopt(zmq.SNDHWM, 0)
    replies.connect(startup.reply_addr)
    try:
        worker, groups = _start(startup)
    except BaseException as e:  # noqa: BLE001 - the executor reports it as the engine's start-up failure
        replies.send_multipart([encode(WorkerReply(seq=STARTUP_SEQ, rank=startup.rank, error=_describe(e))), b""])
        _exit(replies, 1)
    replies.send_multipart([encode(WorkerReply(seq=STARTUP_SEQ, rank=startup.rank)), b""])
    _serve(worker, groups, startup.rank, calls, replies)


def _start(startup):  # noqa: ANN202 - torch types stay out of this module's import time
    from vx.config import decode_config
    from vx.distributed import init_parallel_groups

    config = decode_config(startup.config)
    Worker = worker_class(config.parallel_config.worker_cls)  # noqa: N806
    pc = config.parallel_config
    device = config.device_config.device
    if device == "cuda":  # before NCCL joins: each rank's communicator on its own device
        import torch

        torch.cuda.set_device(startup.local_rank)
    groups = init_parallel_groups(startup.rank, pc.tensor_parallel_size, pc.pipeline_parallel_size,
                                  startup.init_method, device=f"cuda:{startup.local_rank}" if device == "cuda" else device)
    worker = Worker(config, groups, local_rank=startup.local_rank)
    worker.init_device()
    worker.load_model()
    return worker, groups


def _serve(worker, groups, rank: int, calls: zmq.Socket, replies: zmq.Socket) -> None:  # noqa: ANN001
    """Answer calls until `shutdown`. Only the output rank answers `execute_model` (with the step's tokens); any
    rank whose call raises answers with the error, and the engine fails."""
    from vx.step import StepDecoder, encode_step

    decoder = StepDecoder()
    header_decoder = msgspec.msgpack.Decoder(WorkerCall)
    is_output_rank = worker.model_runner.is_output_rank
    collectives = (groups.tp, groups.pp)
    while True:
        header_frame, payload = calls.recv_multipart()
        call = header_decoder.decode(header_frame)
        if call.method == "shutdown":
            break
        t0, comm0 = time.perf_counter(), sum(g.comm_seconds for g in collectives)
        reply = True
        try:
            if call.method == "execute_model":
                result = encode_step(worker.execute_model(decoder.scheduler_output(payload)))
                reply = is_output_rank
            elif call.method == "layer_windows":
                result = encode(worker.layer_windows())
            elif call.method == "determine_kv_cache_size":
                windows = msgspec.msgpack.decode(payload, type=list[int | None] | None)
                result = encode(worker.determine_kv_cache_size(windows))
            elif call.method == "initialize_kv_cache":
                args = msgspec.msgpack.decode(payload, type=InitKVCache)
                worker.initialize_kv_cache(args.num_blocks, args.groups)
                result = b""
            else:
                raise ValueError(f"unknown worker call {call.method!r}")
        except BaseException as e:  # noqa: BLE001 - the executor fails the engine with this message
            logger.error("vx worker %d: %s failed: %s", rank, call.method, _describe(e))
            replies.send_multipart([encode(WorkerReply(seq=call.seq, rank=rank, error=_describe(e))), b""])
            continue
        if reply:
            header = WorkerReply(seq=call.seq, rank=rank, compute_s=time.perf_counter() - t0,
                                 comm_s=sum(g.comm_seconds for g in collectives) - comm0)
            replies.send_multipart([encode(header), result], copy=False)
    worker.shutdown()
    from vx.distributed import destroy_parallel_groups

    destroy_parallel_groups()
    _exit(replies, 0)


def worker_class(name: str) -> type:
    """The worker class `ParallelConfig.worker_cls` names: "auto" is vx's `Worker`."""
    from vx.gpu.worker import Worker

    if name == "auto":
        return Worker
    module_name, _, class_name = name.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Worker)):
        raise ValueError(f"worker_cls={name!r} names no vx.gpu.worker.Worker subclass.")
    return cls


def watch_parent(fd: int) -> None:
    """Exit when the engine process dies, even by SIGKILL: a daemon thread waits for end-of-file on `fd` (the
    engine's pipe), and checks once a second that the engine is still the parent."""
    parent_pid = os.getppid()

    def watch() -> None:
        while os.getppid() == parent_pid:
            readable, _, _ = select.select([fd], [], [], _PARENT_POLL_S)
            if readable and not os.read(fd, 4096):
                break
        os._exit(1)

    threading.Thread(target=watch, name="vx-worker-parent-watchdog", daemon=True).start()


def _describe(e: BaseException) -> str:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    return f"{type(e).__name__}: {e}\n{tb}"


def _exit(replies: zmq.Socket, code: int) -> None:
    """Let the last reply leave, then skip the interpreter's teardown of torch & co."""
    replies.close(linger=2000)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
