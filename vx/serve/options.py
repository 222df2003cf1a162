"""What an operator tunes in `vx serve`: request limits, read timeouts, shutdown and engine-death behaviour.

`ServerOptions` is one frozen dataclass: `build_app(llm, options=ServerOptions(...))` takes it, and `vx serve` has
one flag per field (`max_body_bytes` -> `--max-body-bytes`, with the field's help). Every default is safe for a
server that faces a network.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from vx.sampling_params import MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from vx.serve.reasoning import REASONING_PARSERS

MiB = 1024 * 1024
# Options that may only lower a bound `vx.SamplingParams` sets for every caller of the engine.
_ENGINE_BOUNDS = {"max_stop_strings": MAX_STOP_STRINGS, "max_stop_string_chars": MAX_STOP_STRING_CHARS,
                  "max_bad_words": MAX_BAD_WORDS, "max_bad_word_chars": MAX_BAD_WORD_CHARS}


@dataclass(frozen=True)
class ServerOptions:
    """The limits and behaviours of one server; see docs/serve.md for what a client gets when one is hit."""

    max_body_bytes: int = field(default=8 * MiB, metadata={"help": (
        "the largest request body accepted, in bytes; a larger one is answered 413, from its Content-Length "
        "before it is read, or as soon as a chunked body passes the limit")})
    max_concurrent_requests: int = field(default=512, metadata={"help": (
        "generation requests (completions, chat, responses, embeddings) handled at once; more are answered 429 "
        "with Retry-After")})
    max_requests_per_client: int = field(default=384, metadata={"help": (
        "generation requests one client address (an IPv6 /64) may have in flight, its body still arriving or "
        "running; more are answered 429 with Retry-After. Three quarters of the default --max-concurrent-requests "
        "(raise the two together): a busy client, such as a load test or a batch job, may use most of the server, "
        "and a quarter is always left to everyone else. In-process requests (vx.openai_client) are not counted. "
        "Behind a reverse proxy every client has the proxy's address unless uvicorn trusts its X-Forwarded-For "
        "(FORWARDED_ALLOW_IPS): raise this to --max-concurrent-requests then")})
    max_slow_bodies_per_client: int = field(default=64, metadata={"help": (
        "request bodies one client address may be slow to send (still arriving after a second; a working client's "
        "arrive within milliseconds, however many it sends at once); while it has this many, its new requests with "
        "a body are answered 429 with Retry-After. A slow sender holds a request slot for up to --body-timeout "
        "each: this stops it from taking more")})
    max_prompts: int = field(default=2048, metadata={"help": (
        "prompts in one completions request, and inputs in one embeddings request (OpenAI's embeddings limit); "
        "each is an engine request: 400 beyond")})
    max_sequences: int = field(default=2048, metadata={"help": (
        "sequences one request may ask for: its prompts times n, each a sequence the engine runs; 400 beyond. "
        "Allows n=128 (OpenAI's most, the engine's max_n_sequences) for 16 prompts, or a batch of 2048 prompts")})
    max_request_tokens: int = field(default=2 ** 21, metadata={"help": (
        "tokens one request may ask the engine for: summed over its prompts, the prompt plus n times max_tokens "
        "(unset: all the room the context leaves); 400 beyond. 2^21 lets n=128 samples each fill a 16k-token "
        "context; more is a batch job for vx.LLM")})
    max_logprob_entries: int = field(default=2 ** 20, metadata={"help": (
        "log-probabilities one response may carry: each sample's positions (the echoed prompt and the generated "
        "tokens) times (logprobs + 1), summed over samples; 400 beyond. Each is a few tens of bytes of JSON; the "
        "default allows 20 top logprobs over 49,000 positions")})
    max_stop_strings: int = field(default=MAX_STOP_STRINGS, metadata={"help": (
        "stop strings in one request (every sample's new text is searched for each, per token); 400 beyond. "
        "OpenAI takes 4; vx.SamplingParams' own bound is the most this may be")})
    max_stop_string_chars: int = field(default=MAX_STOP_STRING_CHARS, metadata={"help": (
        "the longest stop string, in characters (a stream holds back that much text while a match is "
        "undecided); 400 beyond. vx.SamplingParams' own bound is the most this may be")})
    max_bad_words: int = field(default=MAX_BAD_WORDS, metadata={"help": (
        "bad_words in one request (the engine matches each against every sample at every step); 400 beyond. "
        "vx.SamplingParams' own bound is the most this may be")})
    max_bad_word_chars: int = field(default=MAX_BAD_WORD_CHARS, metadata={"help": (
        "the longest bad_words entry, in characters; 400 beyond. vx.SamplingParams' own bound is the most this "
        "may be")})
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
        for name, bound in _ENGINE_BOUNDS.items():
            if getattr(self, name) > bound:
                raise ValueError(f"{name} may be at most {bound}, the bound vx.SamplingParams sets for every "
                                 f"request, got {getattr(self, name)}.")
