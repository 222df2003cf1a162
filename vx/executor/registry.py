"""The executors a config can name (`distributed_executor_backend`), one row each, and the lookup of the class.

Rows are "package.module:Class" paths, imported only when named: the Ray executor's module imports `ray`. Any other
backend string is itself such a path (a test's faulty executor, a user's own).
"""

from __future__ import annotations

from vx.class_path import load_class
from vx.config import VxConfig
from vx.executor.abstract import Executor

EXECUTOR_CLASSES = {
    "uni": "vx.executor.uniproc_executor:UniProcExecutor",  # one worker in the engine's process
    "mp": "vx.executor.multiproc:MultiprocExecutor",  # a worker process per rank
    "ray": "vx.executor.ray:RayExecutor",  # a Ray actor per rank
}


def executor_class(config: VxConfig) -> type[Executor]:
    """The executor class `config.parallel_config.distributed_executor_backend` names, imported here (in the engine
    process)."""
    backend = config.parallel_config.distributed_executor_backend
    return load_class(EXECUTOR_CLASSES.get(backend, backend), Executor, "distributed_executor_backend")
