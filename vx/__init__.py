"""vx: an embeddable async streaming LLM inference engine (vLLM v1 architecture).

Public names load lazily, so `import vx` stays cheap and importing one part never drags in another.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from vx.version import __version__

_EXPORTS = {
    "AsyncLLM": "vx.client.async_llm",
    "DEFAULT_MODEL": "vx.config.model_source",
    "LLM": "vx.client.llm",
    "LLMEngine": "vx.client.llm_engine",
    "EngineArgs": "vx.config",
    "EngineDeadError": "vx.errors",
    "EngineOverloadedError": "vx.errors",
    "InvalidRequestError": "vx.errors",
    "CompletionOutput": "vx.outputs",
    "EmbeddingOutput": "vx.outputs",
    "EmbeddingRequestOutput": "vx.outputs",
    "EngineStats": "vx.outputs",
    "Logprob": "vx.outputs",
    "RequestOutput": "vx.outputs",
    "PoolingParams": "vx.pooling_params",
    "RequestOutputKind": "vx.sampling_params",
    "SamplingParams": "vx.sampling_params",
    "StructuredOutputsParams": "vx.sampling_params",
    "openai_client": "vx.serve.openai_client",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from vx.client.async_llm import AsyncLLM
    from vx.client.llm import LLM
    from vx.client.llm_engine import LLMEngine
    from vx.config import EngineArgs
    from vx.config.model_source import DEFAULT_MODEL
    from vx.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
    from vx.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, EngineStats, Logprob,
                            RequestOutput)
    from vx.pooling_params import PoolingParams
    from vx.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vx' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
