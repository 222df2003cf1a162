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


class EngineOverloadedError(EngineGenerateError):
    """The engine could not take the request now (every grammar compile thread stayed busy past the deadline):
    not the request's fault, and the same request may well succeed when retried later."""


class InvalidRequestError(EngineGenerateError, ValueError):
    """The engine refused the request because of its input (e.g. a grammar that does not compile, or exceeds the
    compile limits): a client error, like the `ValueError`s the front end raises before sending a request."""
