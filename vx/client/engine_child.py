"""The engine's OS process: launched as `python -m vx.core.engine_main` (vx/module_process.py: its stdin carries the
`EngineStartup` message and then stays open as the parent-death pipe; a sentinel pipe tells the client when it
exits). The engine's stdout and stderr are the client's."""

from __future__ import annotations

import sys

from vx.core.protocol import EngineStartup, encode_startup
from vx.module_process import ModuleProcess

_ENGINE_MODULE = "vx.core.engine_main"


class EngineChild(ModuleProcess):
    """One started engine process."""

    def __init__(self, config_bytes: bytes, input_addr: str, output_addr: str, ipc_dir: str) -> None:
        super().__init__(_ENGINE_MODULE, lambda sentinel_fd: encode_startup(EngineStartup(
            config=config_bytes, input_addr=input_addr, output_addr=output_addr, ipc_dir=ipc_dir,
            sys_path=list(sys.path), sentinel_fd=sentinel_fd)))
