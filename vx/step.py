"""The step types: what the scheduler hands the workers each step, and what they hand back.

msgspec Structs that cross a process boundary as they are (`encode_step` / `StepDecoder`), in a leaf module that
imports neither `vx.core` nor `vx.gpu`, as vLLM's `v1/core/sched/output.py` and `v1/outputs.py`. A request the
workers have not seen (or that comes back after preemption) is sent whole once, as `NewRequestData`; after that each
step sends only what changed, as `CachedRequestData`. The workers keep the rest (vx/gpu/input_batch.py).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from vx.pooling_params import PoolingParams
from vx.sampling_params import SamplingParams


class TokenLogprobs(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """Logprobs at consecutive positions: per position, the chosen (or prompt) token first, then the top-k.

    Raw: the log-softmax of the model's logits, before penalties, temperature or any other processing (as vLLM's
    default). `ranks[j]` is the chosen token's rank at position j (1 = most likely).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def __len__(self) -> int:
        return len(self.ranks)

    def slice(self, start: int, stop: int | None = None) -> "TokenLogprobs":
        """The positions [start, stop)."""
        return TokenLogprobs(token_ids=self.token_ids[start:stop], logprobs=self.logprobs[start:stop],
                             ranks=self.ranks[start:stop])

    def extend(self, other: "TokenLogprobs") -> None:
        """Append `other`'s positions."""
        self.token_ids.extend(other.token_ids)
        self.logprobs.extend(other.logprobs)
        self.ranks.extend(other.ranks)


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """A request scheduled for the first time, or again after preemption: all the workers need to run it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # its whole block table, one per KV-cache group (most models: one)
    num_computed_tokens: int  # tokens whose KV those blocks already hold (a prefix-cache hit)
    output_token_ids: list[int] = []  # the output so far (resumed after preemption)
    # For the logits processors (repetition penalty, min_tokens, bad words):
    eos_token_ids: tuple[int, ...] = ()
    bad_words_token_ids: list[list[int]] | None = None
    pooling_params: PoolingParams | None = None  # set: it pools its prompt instead of sampling


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """A request the workers hold from an earlier step: only what changed since it was last scheduled."""

    req_id: str
    num_computed_tokens: int
    new_token_ids: list[int] = []  # tokens it gained since (the ones sampled for it)
    new_block_ids: list[list[int]] = []  # blocks added to its table of each group since


class SchedulerOutput(msgspec.Struct, omit_defaults=True, kw_only=True):
    """The plan for one engine step. The batch runs the cached requests first, then the new ones, in list order."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # req id -> tokens to compute now, from its `num_computed_tokens` on
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = set()  # ended since the last step: the workers drop their state
    preempted_req_ids: set[str] = set()  # their state is dropped too; they come back as new requests
    # Structured output: row i of `grammar_bitmask` (int32 [len(grammar_req_ids), ceil(vocab / 32)], bit t set =
    # token t allowed) masks the logits of request `grammar_req_ids[i]`, one of the requests that sample now.
    grammar_req_ids: list[str] = []
    grammar_bitmask: np.ndarray | None = None

    @property
    def req_ids(self) -> list[str]:
        """The scheduled requests in batch order."""
        return [r.req_id for r in self.scheduled_cached_reqs] + [r.req_id for r in self.scheduled_new_reqs]

    @property
    def num_reqs(self) -> int:
        return len(self.scheduled_cached_reqs) + len(self.scheduled_new_reqs)


class ModelRunnerOutput(msgspec.Struct, omit_defaults=True):
    """What the model produced in one step: a sampled token per request that sampled."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    # Per sampling row, when some row asked for `logprobs`: that row's logprobs (None for rows that did not).
    logprobs: list[TokenLogprobs | None] | None = None
    # req id -> (first prompt position, logprobs of the prompt tokens that follow), for `prompt_logprobs` rows.
    prompt_logprobs: dict[str, tuple[int, TokenLogprobs]] | None = None
    # req id -> error message, for the requests whose own work in this step failed (their sampling state, their
    # sampling); they sampled nothing and must end. An internal error of that request alone: the step went on.
    failed: dict[str, str] = {}
    # req id -> embedding, for the pooling requests whose prompt this step finished (they sampled nothing).
    pooled: dict[str, list[float]] | None = None

    @classmethod
    def empty(cls) -> "ModelRunnerOutput":
        return cls([], [])


# ------------------------------------------------------------------------------------------- on the wire
# numpy arrays (the grammar bitmask) travel as [dtype, shape, raw bytes]: no pickle.

def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return (obj.dtype.str, obj.shape, np.ascontiguousarray(obj).tobytes())
    raise TypeError(f"vx.step cannot encode {type(obj).__name__}")


def _dec_hook(type_: type, obj: Any) -> Any:
    if type_ is np.ndarray:
        dtype, shape, data = obj
        return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy()
    raise TypeError(f"vx.step cannot decode {type_}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode_step(msg: SchedulerOutput | ModelRunnerOutput) -> bytes:
    """A step message as msgpack bytes, for a worker in another process."""
    return _ENCODER.encode(msg)


class StepDecoder:
    """Decodes the step messages `encode_step` wrote."""

    def __init__(self) -> None:
        self._scheduler_output = msgspec.msgpack.Decoder(SchedulerOutput, dec_hook=_dec_hook)
        self._runner_output = msgspec.msgpack.Decoder(ModelRunnerOutput, dec_hook=_dec_hook)

    def scheduler_output(self, data: bytes) -> SchedulerOutput:
        return self._scheduler_output.decode(data)

    def model_runner_output(self, data: bytes) -> ModelRunnerOutput:
        return self._runner_output.decode(data)
