"""Per-request sampling controls, named as in vLLM so that vLLM users feel at home."""

from __future__ import annotations

import enum
import json
import math
from typing import Any, Sequence

import msgspec


class RequestOutputKind(enum.IntEnum):
    """What each `RequestOutput` of a streaming request carries."""

    CUMULATIVE = 0  # all text/tokens so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # a single output when the request finishes


# Temperatures below this sample greedily (argmax); the sampler uses the same cut-off.
GREEDY_TEMPERATURE_EPS = 1e-5
_INT_MAX = 2**63 - 1  # every int a request carries fits int64: the wire (msgpack) and torch tensors

# What one request may ask for. The bounds are generous (OpenAI's own are lower: 4 stop strings, 20 top
# logprobs, 1,000 enum values); they keep the work and memory one request can cost the engine bounded.
# `n` is bounded by the engine argument `max_n_sequences`, `top_k` and token ids by the model's vocabulary.
# `vx serve` may lower the stop-string and bad-word bounds per server (vx/serve/options.py), never raise them.
MAX_LOGPROBS = 20
"""The most `logprobs` / `prompt_logprobs` a request may ask for (OpenAI's `top_logprobs` limit, vLLM's default)."""
MAX_STOP_STRINGS = 32
"""The most `stop` strings in one request: every new piece of text of every sample is searched for each of them,
in the application's process, so their number times their length is work per generated token."""
MAX_STOP_STRING_CHARS = 256
"""The longest `stop` string (the stream holds back that many characters while a match is undecided)."""
MAX_STOP_TOKEN_IDS = 1024
"""The most `stop_token_ids` in one request."""
MAX_LOGIT_BIAS = 1024
"""The most `logit_bias` entries in one request."""
MAX_BAD_WORDS = 256
"""The most `bad_words` in one request: the engine matches each word's tokens against every sample's output at
every step, so their number times their length is engine work per step that every other request waits for."""
MAX_BAD_WORD_CHARS = 128
"""The longest `bad_words` entry."""
MAX_STRUCTURED_OUTPUTS_BYTES = 128 * 1024
"""The largest constraint, in UTF-8 bytes: a JSON schema's compact text, a regex, a grammar, or all choices
together. A 100 KiB enum already compiles to ~25 MiB and takes ~0.5 s (see `grammar_compile_timeout_s`)."""
MAX_CHOICES = 1024
"""The most `choice` alternatives of a structured output."""


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Constrain the output to a JSON schema, a regex, one of some strings, or a grammar (vLLM's names).

    Exactly one of the fields is set. `json` is a JSON schema (a dict, or its JSON text); `json_object=True`
    asks for any JSON object; `grammar` is an EBNF (GBNF) grammar; `structural_tag` is the JSON text of an
    xgrammar structural tag (`{"type": "structural_tag", "format": ...}`: text, tags and JSON schemas combined,
    e.g. "content fitting a schema, or tool calls"). The engine compiles it with xgrammar and masks, at every
    step, the tokens that would break it.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """`ValueError` unless exactly one constraint is set, with a value of the right type."""
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams needs exactly one of json, regex, choice, grammar, "
                             f"json_object, structural_tag; got {given or 'none'}.")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"json must be a JSON schema (a dict or its JSON text), got {type(self.json).__name__}.")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty str, got {value!r}.")
        if self.choice is not None:
            _check_str_list("choice", self.choice, "a non-empty list of strings")
            if not self.choice:
                raise ValueError("choice must be a non-empty list of strings.")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {self.json_object!r}.")
        if self.choice is not None and len(self.choice) > MAX_CHOICES:
            raise ValueError(f"choice has {len(self.choice)} entries; at most {MAX_CHOICES} are allowed.")
        size = self._spec_bytes()
        if size is not None and size > MAX_STRUCTURED_OUTPUTS_BYTES:
            raise ValueError(f"structured_outputs.{self.kind} is {size} bytes long; at most "
                             f"{MAX_STRUCTURED_OUTPUTS_BYTES} bytes are allowed.")

    def _spec_bytes(self) -> int | None:
        """The constraint's size in UTF-8 bytes (None for a `json` dict that is not JSON: the front end's
        `check_structured_outputs` reports that with the submission)."""
        if isinstance(self.json, dict):
            try:
                return len(json.dumps(self.json, ensure_ascii=False, separators=(",", ":")).encode())
            except (TypeError, ValueError):  # not JSON-serializable
                return None
        if self.choice is not None:
            return sum(len(c.encode()) for c in self.choice)
        text = self.json if isinstance(self.json, str) else self.regex or self.grammar or self.structural_tag
        return len(text.encode()) if text else 0

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar", "structural_tag" or "json_object"."""
        for name in ("json", "regex", "choice", "grammar", "structural_tag"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to sample one request. Validated at construction: bad values raise `ValueError`."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    priority: int = 0
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Normalize (`stop="x"` -> `["x"]`, `top_k=-1` -> 0) and check every field; `ValueError` if one is bad.

        Runs at construction (and `clone`); call it again after changing fields in place.
        """
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1 and type(self.top_k) is int:
            self.top_k = 0
        self._verify()

    # ------------------------------------------------------------------ checks
    def _verify(self) -> None:
        _check_int("n", self.n, lo=1, hi=_INT_MAX)
        _check_num("temperature", self.temperature, lo=0.0)
        _check_num("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        _check_int("top_k", self.top_k, lo=0, hi=_INT_MAX)
        _check_num("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None:
            _check_int("seed", self.seed, lo=-(2**63), hi=_INT_MAX)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1, hi=_INT_MAX)
        _check_int("min_tokens", self.min_tokens, lo=0, hi=_INT_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})."
            )
        if self.stop is not None:
            _check_str_list("stop", self.stop, "a string or a list of strings", MAX_STOP_STRINGS,
                            MAX_STOP_STRING_CHARS)
            if any(s == "" for s in self.stop):
                raise ValueError("stop strings must not be empty.")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list):
                raise ValueError("stop_token_ids must be a list of ints.")
            _check_len("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
            for t in self.stop_token_ids:
                _check_int("stop_token_ids[i]", t, lo=0, hi=_INT_MAX)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}.")
        if not isinstance(self.output_kind, RequestOutputKind):
            if isinstance(self.output_kind, bool) or not isinstance(self.output_kind, int):
                raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.")
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.") from None
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS)
        _check_num("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_num("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_num("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}.")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must be a dict of token id -> bias.")
            _check_len("logit_bias", self.logit_bias, MAX_LOGIT_BIAS)
            for k, v in self.logit_bias.items():
                _check_int("logit_bias key", k, lo=0, hi=_INT_MAX)
                _check_num("logit_bias value", v, lo=-100.0, hi=100.0)
        if self.bad_words is not None:
            _check_str_list("bad_words", self.bad_words, "a list of strings", MAX_BAD_WORDS, MAX_BAD_WORD_CHARS)
        _check_int("priority", self.priority, lo=-(2**31), hi=2**31 - 1)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a vx.StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}.")
            self.structured_outputs.verify()

    def verify_for_model(self, vocab_size: int) -> None:
        """The checks that need the model: `top_k` and every token id (`stop_token_ids`, `logit_bias` keys)
        within its vocabulary of `vocab_size` tokens; `ValueError` naming the field otherwise."""
        if self.top_k > vocab_size:
            raise ValueError(f"top_k={self.top_k} exceeds the model's vocabulary size ({vocab_size}); use 0 "
                             "(or -1) to keep all tokens.")
        if self.stop_token_ids:
            check_token_ids("stop_token_ids entry", self.stop_token_ids, vocab_size)
        if self.logit_bias:
            check_token_ids("logit_bias key", list(self.logit_bias), vocab_size)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    def clone(self, **changes: Any) -> "SamplingParams":
        """A validated copy with some fields changed."""
        return msgspec.structs.replace(self, **changes)


def _check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}.")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}.")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}.")


def _check_num(name: str, value: Any, lo: float | None = None, hi: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}.")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}.")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}.")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}.")


def check_token_ids(what: str, ids: Sequence[Any], vocab_size: int) -> None:
    """Every id must be an int in [0, vocab_size): the model has no embedding row or logit for anything else.
    `ValueError` naming `what`, the id and its position otherwise."""
    try:  # the common case, at C speed: all ints, all in range
        if all(type(t) is int for t in ids) and (not ids or (min(ids) >= 0 and max(ids) < vocab_size)):
            return
    except TypeError:
        pass
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"{what} at position {i} must be an int, got {type(t).__name__} {t!r}.")
        if not 0 <= t < vocab_size:
            raise ValueError(f"{what} {t} (position {i}) is outside the model's vocabulary [0, {vocab_size}).")


def _check_len(name: str, value: Any, most: int) -> None:
    if len(value) > most:
        raise ValueError(f"{name} has {len(value)} entries; at most {most} are allowed.")


def _check_str_list(name: str, value: Any, what: str, most: int | None = None, longest: int | None = None) -> None:
    """`value` must be a list of str, each encodable as UTF-8 (a lone surrogate such as "\\ud800" is not), with at
    most `most` entries of at most `longest` characters."""
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ValueError(f"{name} must be {what}, got {value!r}.")
    if most is not None:
        _check_len(name, value, most)
    for s in value:
        if longest is not None and len(s) > longest:
            raise ValueError(f"{name} entry of {len(s)} characters is too long; at most {longest} are allowed.")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{name} entry {s!r} is not valid UTF-8: {e}") from None
