"""A worker process's entry point, run as `python -m vx.executor.worker_main` by `vx.executor.worker_process`.

Started as its own module (never as a multiprocessing target), so it never re-imports the application's main
module. Its stdin is a pipe from the engine: first the `WorkerStartup` message, then nothing; end-of-file there (or
a new parent) means the engine is gone, and the worker exits at once, even in the middle of a collective.

It joins the process group of its rank, loads its shard, answers the start-up, then serves the executor's calls
(each broadcast to every worker) until `shutdown`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

# Ctrl-C belongs to the application, which shuts the engine (and so the workers) down.
signal.signal(signal.SIGINT, signal.SIG_IGN)

import msgspec  # noqa: E402
import zmq  # noqa: E402

from vx import platform, progress  # noqa: E402
from vx.executor.worker_protocol import STARTUP_SEQ, WorkerCall, WorkerReply, encode, read_startup  # noqa: E402
from vx.module_process import describe_exception, join_parent  # noqa: E402

logger = logging.getLogger("vx.executor.worker_main")  # `__name__` is "__main__" here


def main() -> None:
    """Read the startup message, watch the engine, join the world, load, serve (never returns)."""
    progress.show_progress()  # what a first start builds, on the stderr this process shares with the application
    startup = join_parent(read_startup, "vx-worker-parent-watchdog")
    platform.prefer_openmp_wait_policy()  # before torch is imported
    ctx = zmq.Context()
    calls = ctx.socket(zmq.SUB)
    calls.setsockopt(zmq.RCVHWM, 0)
    calls.setsockopt(zmq.SUBSCRIBE, b"")
    calls.connect(startup.call_addr)  # first: the executor waits for every subscription before its first call
    replies = ctx.socket(zmq.PUSH)
    replies.setsockopt(zmq.SNDHWM, 0)
    replies.connect(startup.reply_addr)
    from vx.executor.worker_host import WorkerHost

    try:
        host = WorkerHost(startup.config, startup.rank, startup.local_rank, startup.init_method)
    except BaseException as e:  # noqa: BLE001 - the executor reports it as the engine's start-up failure
        error = describe_exception(e)
        replies.send_multipart([encode(WorkerReply(seq=STARTUP_SEQ, rank=startup.rank, error=error)), b""])
        _exit(ctx, calls, replies, 1)
    replies.send_multipart([encode(WorkerReply(seq=STARTUP_SEQ, rank=startup.rank)), b""])
    header_decoder = msgspec.msgpack.Decoder(WorkerCall)
    while True:  # answer calls until `shutdown`
        header_frame, payload = calls.recv_multipart()
        call = header_decoder.decode(header_frame)
        if call.method == "shutdown":
            break
        answer = host.call(call.seq, call.method, payload)
        if answer is not None:
            replies.send_multipart([encode(answer[0]), answer[1]], copy=False)
    host.shutdown()
    _exit(ctx, calls, replies, 0)


def _exit(ctx: zmq.Context, calls: zmq.Socket, replies: zmq.Socket, code: int) -> None:
    """Let the last reply leave (terminating the context waits for it, up to the linger), then skip the
    interpreter's teardown of torch & co."""
    calls.close(linger=0)
    replies.close(linger=2000)
    ctx.term()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
