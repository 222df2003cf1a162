"""Executors: how the engine core reaches its workers: one in-process worker (`UniProcExecutor`), a worker process
per rank (`vx.executor.multiproc.MultiprocExecutor`), a Ray actor per rank (`vx.executor.ray.RayExecutor`); the
last two are imported when a config names them (`vx.executor.registry`)."""

from vx.executor.abstract import Executor
from vx.executor.uniproc_executor import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor"]
