"""Exceptions that vx raises to applications."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine stopped (crashed, was killed, or was shut down); no request can proceed.

    ``__cause__`` carries the original error when one is known.
    """

    def __init__(self, message: str = "The vx engine is dead; create a new LLM/AsyncLLM.") -> None:
        super().__init__(message)


class EngineGenerateError(RuntimeError):
    """A single request failed inside the engine while the engine itself kept running."""
