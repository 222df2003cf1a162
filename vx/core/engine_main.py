"""The engine process's entry point, run as `python -m vx.core.engine_main` by `vx.client.engine_process`.

Started as its own module (never as a multiprocessing target), the engine process imports nothing of the
application: no `__main__` re-import, so scripts without an `if __name__ == "__main__":` guard, `python -`,
`python -c` and notebooks all start it. Its stdin is a pipe from the client: first the `EngineStartup` message,
then nothing; end-of-file on it means the client is gone, and the engine exits.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys

# Ctrl-C belongs to the application (the whole foreground process group gets it), which shuts the engine down.
signal.signal(signal.SIGINT, signal.SIG_IGN)

import zmq  # noqa: E402 - after SIGINT is ignored: importing takes a while

from vx import platform, progress  # noqa: E402
from vx.config import decode_config  # noqa: E402
from vx.core.engine_core import OUTPUT_LINGER_MS, EngineCore, EngineCoreProc  # noqa: E402
from vx.core.protocol import EngineCoreReady, encode_output, read_startup  # noqa: E402
from vx.module_process import describe_exception, join_parent  # noqa: E402

logger = logging.getLogger("vx.core.engine_main")  # `__name__` is "__main__" here


def main() -> None:
    """Read the startup message, watch the client, then serve until shut down (never returns)."""
    progress.show_progress()  # what a first start builds, on the stderr this process shares with the application
    # When the client dies, nobody else is left to remove the ipc directory.
    startup = join_parent(read_startup, "vx-parent-watchdog",
                          lambda startup: shutil.rmtree(startup.ipc_dir, ignore_errors=True))
    run_engine_core_proc(startup.config, startup.input_addr, startup.output_addr)


def run_engine_core_proc(config_bytes: bytes, input_addr: str, output_addr: str) -> None:
    """Build the engine, handshake, serve, exit (never returns).

    `config_bytes` is the front end's resolved `VxConfig` (`encode_config`), used here as it is. A start-up
    failure goes back through the handshake, with its traceback.
    """
    ctx = zmq.Context()
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow reader
    out_sock.connect(output_addr)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.setsockopt(zmq.RCVHWM, 0)
    in_sock.connect(input_addr)
    try:
        platform.prefer_openmp_wait_policy()  # before decoding the config imports transformers, hence torch
        core = EngineCore(decode_config(config_bytes))
    except BaseException as e:  # noqa: BLE001 - report any start-up failure through the handshake
        logger.error("vx engine failed to start: %s", describe_exception(e))
        out_sock.send(encode_output(EngineCoreReady(pid=os.getpid(), error=describe_exception(e))))
        in_sock.close(linger=0)
        out_sock.close(linger=OUTPUT_LINGER_MS)
        ctx.term()
        _exit(1)
    out_sock.send(encode_output(EngineCoreReady(pid=os.getpid(), num_kv_blocks=core.num_kv_blocks)))
    code = EngineCoreProc(core, in_sock, out_sock).run()
    # Returns once the input thread has closed its socket (it sees ETERM) and the output has flushed.
    ctx.term()
    _exit(code)


def _exit(code: int) -> None:
    """Everything is sent and released: skip the interpreter's teardown of torch & co, which takes seconds."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
