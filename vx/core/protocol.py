"""Every message between the client and the engine core, as msgspec Structs (msgpack on the wire, no pickle)."""

from __future__ import annotations

import enum
from typing import Any, BinaryIO

import msgspec

from vx.errors import EngineGenerateError, EngineOverloadedError, InvalidRequestError
from vx.module_process import frame_startup, read_startup_body
from vx.pooling_params import PoolingParams
from vx.sampling_params import SamplingParams, check_token_ids
from vx.step import TokenLogprobs


class FinishReason(enum.IntEnum):
    """Why a request ended. Compact on the wire; `str()` gives the OpenAI-style name."""

    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """A tokenized, validated request for the engine core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = []
    arrival_time: float = 0.0
    priority: int = 0
    # `sampling_params.bad_words`, tokenized by the front end (each word with and without a leading space).
    bad_words_token_ids: list[list[int]] | None = None
    # Set for an embedding request: it pools its prompt's hidden states and generates nothing (`sampling_params`
    # is then a placeholder the engine does not sample with).
    pooling_params: PoolingParams | None = None
    # The requests of one fan-out (the n children of an `n > 1` request) share a group: the scheduler's fair share
    # of seats and tokens counts them as one client. None: the request is a group of its own.
    group_id: str | None = None

    def verify_for_model(self, vocab_size: int, max_model_len: int) -> None:
        """`ValueError` unless the prompt is 1 to max_model_len - 1 tokens long (max_model_len for a pooling
        request, which generates nothing), every token id (prompt, eos, bad words, params) is in the model's
        vocabulary and the params fit the model. The front end checks the same before sending; the engine checks
        again at admission, since one bad id would fail the whole batch's forward pass, and a prompt that can never
        fit would block the queue."""
        longest = max_model_len if self.pooling_params is not None else max_model_len - 1
        if not 0 < len(self.prompt_token_ids) <= longest:
            raise ValueError(f"The prompt is {len(self.prompt_token_ids)} tokens long; it must have 1 to "
                             f"{longest} tokens (max_model_len is {max_model_len}).")
        check_token_ids("prompt token id", self.prompt_token_ids, vocab_size)
        check_token_ids("eos token id", self.eos_token_ids, vocab_size)
        for word in self.bad_words_token_ids or ():
            check_token_ids("bad_words token", word, vocab_size)
        self.sampling_params.verify_for_model(vocab_size)
        params = self.sampling_params
        if self.pooling_params is not None and (params.structured_outputs is not None or params.logprobs is not None
                                                or params.prompt_logprobs is not None):
            raise ValueError("A pooling (embedding) request samples nothing: structured_outputs, logprobs and "
                             "prompt_logprobs do not apply to it.")


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """New tokens of one request from one engine step, and its end if it ended."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_logprobs: TokenLogprobs | None = None  # one position per new token, when `logprobs` was asked for
    # All the prompt's positions but the first, with the first new token, when `prompt_logprobs` was asked for.
    prompt_logprobs: TokenLogprobs | None = None
    # A pooling request's embedding, with its end (it has no new tokens).
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class InputError(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """An input message the engine could not act on (malformed, unknown, refused), or a request that failed alone
    inside the engine; the request ends, the engine keeps serving."""

    message: str
    request_id: str | None = None  # the request it concerns, when that could be read
    # False: the request's input is at fault (a client error: a grammar that does not compile, a value out of
    # range). True: the engine failed on this request alone (an internal error); the others went on.
    internal: bool = False
    # True: the engine had no capacity for it in time (a busy grammar compile pool); a retry may succeed.
    overloaded: bool = False

    def to_exception(self, request_id: str) -> EngineGenerateError:
        """What the application's call for this request raises (`request_id`: the application's id):
        `InvalidRequestError` (a `ValueError`) when its input is at fault, `EngineOverloadedError` when the engine
        had no capacity for it in time, else `EngineGenerateError`."""
        if self.overloaded:
            return EngineOverloadedError(f"The engine is too busy for request {request_id!r} now: {self.message}")
        if self.internal:
            return EngineGenerateError(f"Request {request_id!r} failed in the engine: {self.message}")
        return InvalidRequestError(f"The engine refused request {request_id!r}: {self.message}")


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """Everything one engine step (or a utility call) sends back.

    `engine_error` set means the engine failed and this is its last message before the process exits.
    """

    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    finished_requests: list[str] = []
    utility_output: "UtilityOutput | None" = None
    engine_error: str | None = None
    input_errors: list[InputError] = []


class EngineCoreRequestType(enum.IntEnum):
    """What an input message to the engine core asks for."""

    ADD = 0
    ABORT = 1
    UTILITY = 2
    SHUTDOWN = 3


class UtilityRequest(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """Call a named method of the engine core (e.g. "stats") and send its result back."""

    call_id: int
    method: str
    args: list[Any] = []


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """The result of a `UtilityRequest`: a msgpack-able value, or an error message."""

    call_id: int
    result: Any = None
    error: str | None = None


class EngineCoreReady(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """The handshake: the engine process's first output message, once it serves or when it failed to start."""

    pid: int
    num_kv_blocks: int = 0
    error: str | None = None  # set when start-up failed; the process exits right after sending it


class EngineStartup(msgspec.Struct, array_like=True, kw_only=True):
    """What the client hands the engine process on its stdin (length-prefixed msgpack) before anything else."""

    config: bytes  # the resolved VxConfig (`encode_config`), used by the engine as it is
    input_addr: str
    output_addr: str
    ipc_dir: str  # the private (0700) directory of the sockets; the engine removes it if the client dies
    sys_path: list[str]  # the application's import path, so a `package.module:Class` backend imports the same
    sentinel_fd: int  # the pipe end the engine holds open until it exits: the client's death notice


# ------------------------------------------------------------------------------------------- wire format
# Input (client -> engine): two frames, [one byte EngineCoreRequestType, msgpack payload].
#   ADD: EngineCoreRequest, ABORT: list[str] (request ids), UTILITY: UtilityRequest, SHUTDOWN: empty.
# Output (engine -> client): one msgpack frame; the first is an EngineCoreReady, all later ones EngineCoreOutputs.

_ENCODER = msgspec.msgpack.Encoder()
_PAYLOAD_TYPES: dict[EngineCoreRequestType, Any] = {
    EngineCoreRequestType.ADD: EngineCoreRequest,
    EngineCoreRequestType.ABORT: list[str],
    EngineCoreRequestType.UTILITY: UtilityRequest,
}


def encode_input(request_type: EngineCoreRequestType, payload: Any = None) -> list[bytes]:
    """The frames of one input message (see the wire format above)."""
    body = b"" if request_type == EngineCoreRequestType.SHUTDOWN else _ENCODER.encode(payload)
    return [bytes((int(request_type),)), body]


def encode_startup(startup: EngineStartup) -> bytes:
    """The startup message as it goes on the engine's stdin (vx.module_process.frame_startup)."""
    return frame_startup(_ENCODER.encode(startup))


def read_startup(stream: BinaryIO) -> EngineStartup:
    """Read exactly one `encode_startup` message from `stream` (the pipe stays open after it)."""
    return msgspec.msgpack.decode(read_startup_body(stream, "the engine's stdin"), type=EngineStartup)


def encode_output(msg: "EngineCoreOutputs | EngineCoreReady") -> bytes:
    """The single frame of one output message."""
    return _ENCODER.encode(msg)


class InputDecoder:
    """Decodes input messages in the engine; anything malformed raises `ValueError` naming what is wrong."""

    def __init__(self) -> None:
        self._decoders = {t: msgspec.msgpack.Decoder(typ) for t, typ in _PAYLOAD_TYPES.items()}
        self._raw = msgspec.msgpack.Decoder()

    def decode(self, frames: list[bytes]) -> tuple[EngineCoreRequestType, Any]:
        """(type, payload) of one input message; `ValueError` when it is malformed or of an unknown type."""
        if len(frames) != 2 or len(frames[0]) != 1:
            raise ValueError(f"malformed input message: expected 2 frames [type byte, payload], got "
                             f"{len(frames)} frame(s)")
        try:
            request_type = EngineCoreRequestType(frames[0][0])
        except ValueError:
            raise ValueError(f"unknown input message type {frames[0][0]}") from None
        if request_type == EngineCoreRequestType.SHUTDOWN:
            return request_type, None
        try:
            return request_type, self._decoders[request_type].decode(frames[1])
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
            raise ValueError(f"malformed {request_type.name} message: {e}") from None

    def request_id_of(self, frames: list[bytes]) -> str | None:
        """Best effort: the request id of a (malformed) ADD message, so its error can reach its request."""
        if len(frames) != 2 or frames[0] != bytes((int(EngineCoreRequestType.ADD),)):
            return None
        try:
            raw = self._raw.decode(frames[1])
        except Exception:
            return None
        rid = raw[0] if isinstance(raw, list) and raw else None
        return rid if isinstance(rid, str) else None


class OutputDecoder:
    """Decodes output messages in the client."""

    def __init__(self) -> None:
        self._outputs = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._ready = msgspec.msgpack.Decoder(EngineCoreReady)

    def decode(self, frame: bytes) -> EngineCoreOutputs:
        """One step's (or utility call's) output message."""
        return self._outputs.decode(frame)

    def decode_ready(self, frame: bytes) -> EngineCoreReady:
        """The handshake, the first message the engine sends."""
        return self._ready.decode(frame)
