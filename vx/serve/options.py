"""What an operator tunes in `vx serve`: request limits, read timeouts, shutdown and engine-death behaviour.

`ServerOptions` is one frozen dataclass: `build_app(llm, options=ServerOptions(...))` takes it, and `vx serve` has
one flag per field (`max_body_bytes` -> `--max-body-bytes`, with the field's help). Every default is safe for a
server that faces a network.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from vx.serve.reasoning import REASONING_PARSERS

MiB = 1024 * 1024


@dataclass(frozen=True)
class ServerOptions:
    """The limits and behaviours of one server; see docs/serve.md for what a client gets when one is hit."""

    max_body_bytes: int = field(default=8 * MiB, metadata={"help": (
        "the largest request body accepted, in bytes; a larger one is answered 413, from its Content-Length "
        "before it is read, or as soon as a chunked body passes the limit")})
    max_concurrent_requests: int = field(default=512, metadata={"help": (
        "generation requests (completions, chat, responses) handled at once; more are answered 429 with Retry-After")})
    header_timeout: float = field(default=10.0, metadata={"help": (
        "seconds a client has to send a request's headers, from its first byte (or from connecting); the "
        "connection is closed after that")})
    body_timeout: float = field(default=30.0, metadata={"help": (
        "seconds a client has to send a whole request body once its headers are in; 408 after that")})
    max_json_depth: int = field(default=64, metadata={"help": (
        "the deepest nesting of arrays and objects accepted in a request body, and in the JSON texts it carries "
        "(tool-call arguments, JSON schemas); 400 beyond")})
    shutdown_grace_period: float = field(default=20.0, metadata={"help": (
        "on SIGTERM or SIGINT, seconds running requests may take to finish before each open stream is ended "
        "with an error event and [DONE]")})
    reasoning_parser: str | None = field(default=None, metadata={"choices": REASONING_PARSERS, "help": (
        "read a thinking model's <think>...</think> block into message.reasoning_content (delta.reasoning_content "
        "when streaming) instead of content: deepseek_r1 (the reply starts inside the block) or qwen3 (a block "
        "that opens the reply, or that the prompt opened); see docs/serve.md")})
    keep_alive_on_engine_death: bool = field(default=False, metadata={"help": (
        "keep serving (503 on every generation request) after the engine dies, instead of draining and exiting "
        "with code 1 so that a supervisor restarts the server")})

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got "
                             f"{self.reasoning_parser!r}.")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", "float") and (isinstance(value, bool) or not isinstance(value, (int, float))
                                               or not value > 0):
                raise ValueError(f"{f.name} must be a positive number, got {value!r}.")
