"""What one server app holds: its engine, the names it serves the model under, its options, its running requests
and its metrics.

Kept on `app.state.vx`, so two apps in one process share nothing.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio

from vx.serve.errors import APIError
from vx.serve.inflight import InFlight
from vx.serve.metrics import ServerMetrics
from vx.serve.template_sandbox import TemplateSandbox
from vx.serve.prompt_tokens import new_tokenize_limiter
from vx.serve.options import ServerOptions


@dataclass
class ServerState:
    llm: Any  # a vx.AsyncLLM (started by the app's lifespan, or by the caller)
    served_model_names: list[str]
    api_key: str | None = None
    chat_template: str | None = None  # overrides the tokenizer's template
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    trust_request_chat_template: bool = False  # accept `chat_template` in a request (rendered in the sandbox)
    templates: TemplateSandbox = field(default_factory=TemplateSandbox)  # renders every chat template
    tokenize_limiter: anyio.CapacityLimiter = field(default_factory=new_tokenize_limiter)  # vx/serve/prompt_tokens.py
    options: ServerOptions = field(default_factory=ServerOptions)
    inflight: InFlight = field(default_factory=InFlight)

    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int | None:
        config = self.llm.config
        return config.model_config.max_model_len if config is not None else None

    @property
    def max_n_sequences(self) -> int | None:
        """The engine's bound on `n` (None before the engine started)."""
        config = self.llm.config
        return config.scheduler_config.max_n_sequences if config is not None else None

    def model_name(self, requested: str | None) -> str:
        """The name to answer under: the requested one if this server serves it (404 otherwise), else the first."""
        if requested is None or requested == "":
            return self.served_model_names[0]
        if requested not in self.served_model_names:
            raise APIError(f"The model {requested!r} does not exist; this server serves "
                           f"{', '.join(map(repr, self.served_model_names))}.", 404, param="model",
                           code="model_not_found")
        return requested


def new_id(prefix: str) -> str:
    """A response id in OpenAI's style (`cmpl-...`, `chatcmpl-...`)."""
    return f"{prefix}-{uuid.uuid4().hex}"
