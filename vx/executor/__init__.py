"""Executors: how the engine core reaches its workers (one in-process worker today; worker processes and Ray
actors beside it later)."""

from vx.executor.abstract import Executor
from vx.executor.uniproc_executor import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor"]
