"""Input processing in the application's process: validate a prompt and its params, tokenize, build the request.

Everything that can be wrong with a request is found here and raised as `ValueError` before anything is sent,
so a bad request never reaches (or disturbs) the engine.
"""

from __future__ import annotations

import json
import time
from typing import Any

from vx.client.tokenizer import eos_token_ids
from vx.config import DEFAULT_MAX_N_SEQUENCES, ModelConfig
from vx.core.protocol import EngineCoreRequest
from vx.pooling_params import PoolingParams, check_dimensions
from vx.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams, check_token_ids


class Processor:
    """Turns (request id, prompt, params) into a validated, tokenized `EngineCoreRequest`."""

    def __init__(self, model_config: ModelConfig, tokenizer: Any,
                 max_n_sequences: int = DEFAULT_MAX_N_SEQUENCES) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer  # a fast HF tokenizer; None accepts token-id prompts only
        # The engine refuses an out-of-vocabulary stop id; a tokenizer's eos beyond the model's logits never
        # comes out anyway.
        self.eos_token_ids = [t for t in eos_token_ids(tokenizer, model_config.eos_token_ids)
                              if 0 <= t < model_config.vocab_size]
        self.max_n_sequences = max_n_sequences  # the engine argument: the most samples (`n`) of one request

    def process_inputs(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams | None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> EngineCoreRequest:
        """Validate and tokenize one request. `params=None` means default `SamplingParams()`; `PoolingParams` make
        it an embedding request.

        max_tokens is clamped so that prompt + output never exceed max_model_len (None -> all the room left).
        `priority` (if non-zero) overrides `params.priority`. Raises `ValueError` on any bad input.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}.")
        if isinstance(priority, bool) or not isinstance(priority, int) or not -(2**31) <= priority < 2**31:
            raise ValueError(f"priority must be an int32, got {type(priority).__name__} {priority!r}.")
        if arrival_time is not None and (isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float))):
            raise ValueError(f"arrival_time must be a float (time.time()) or None, got {arrival_time!r}.")
        if isinstance(params, PoolingParams):
            return self._process_pooling(request_id, prompt, params, arrival_time, priority)
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a vx.SamplingParams, a vx.PoolingParams or None, got "
                             f"{type(params).__name__}.")
        else:
            params.verify()  # fields may have been changed in place since construction

        prompt_token_ids = self._tokenize(prompt)
        self._check_token_ids("prompt token id", prompt_token_ids)
        prompt_len, max_len = len(prompt_token_ids), self.model_config.max_model_len
        if prompt_len >= max_len:
            raise ValueError(
                f"The prompt is {prompt_len} tokens long, but max_model_len is {max_len}: the prompt plus at "
                f"least one generated token must fit, so the prompt may have at most {max_len - 1} tokens."
            )
        if params.n > self.max_n_sequences:
            raise ValueError(f"n={params.n} exceeds the engine's max_n_sequences ({self.max_n_sequences}), the most "
                             "parallel samples one request may ask for.")
        if params.stop and self.tokenizer is None:
            raise ValueError("Stop strings need a tokenizer to detokenize the output; none is loaded.")
        params.verify_for_model(self.model_config.vocab_size)
        bad_words_token_ids = self._tokenize_bad_words(params.bad_words) if params.bad_words else None
        if params.structured_outputs is not None:
            check_structured_outputs(params.structured_outputs)

        room = max_len - prompt_len
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if max_tokens != params.max_tokens:
            # Never mutate the caller's params (they may be shared by many requests): clone (and re-validate).
            params = params.clone(max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))

        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_ids=list(self.eos_token_ids),
            arrival_time=time.time() if arrival_time is None else float(arrival_time),
            priority=priority or params.priority,
            bad_words_token_ids=bad_words_token_ids,
        )

    def _process_pooling(self, request_id: str, prompt: str | list[int], params: PoolingParams,
                         arrival_time: float | None, priority: int) -> EngineCoreRequest:
        """An embedding request: its prompt may fill max_model_len (nothing is generated); `dimensions` only where
        the model's config allows it (`check_dimensions`)."""
        params.verify()  # fields may have been changed in place since construction
        check_dimensions(params, self.model_config.hf_config)
        prompt_token_ids = self._tokenize(prompt)
        self._check_token_ids("prompt token id", prompt_token_ids)
        prompt_len, max_len = len(prompt_token_ids), self.model_config.max_model_len
        if prompt_len > max_len:
            raise ValueError(f"The prompt is {prompt_len} tokens long, but max_model_len is {max_len}: an "
                             f"embedding's prompt may have at most {max_len} tokens.")
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            # Never sampled with: a pooling request ends with its prompt. FINAL_ONLY: it has one output.
            sampling_params=SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY),
            arrival_time=time.time() if arrival_time is None else float(arrival_time),
            priority=priority,
            pooling_params=params,
        )

    def _tokenize_bad_words(self, bad_words: list[str]) -> list[list[int]] | None:
        """Token-id sequences of the bad words, as vLLM makes them: each word as is (leading spaces stripped),
        and again with one leading space when that spelling tokenizes to a different first token but as many
        tokens, so that a word is banned both at the start of the text and after a space."""
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer to be tokenized; none is loaded.")
        out: list[list[int]] = []
        for word in bad_words:
            plain = list(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if not plain:
                continue  # an empty (or all-space) word bans nothing
            self._check_token_ids(f"bad_words {word!r} token", plain)
            out.append(plain)
            spaced = list(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                self._check_token_ids(f"bad_words {word!r} token", spaced)
                out.append(spaced)
        return out or None

    def _tokenize(self, prompt: Any) -> list[int]:
        """Token ids of a text prompt (with the tokenizer's special tokens, e.g. BOS), or a checked id list."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("The prompt is empty; give a non-empty string or a non-empty list of token ids.")
            if self.tokenizer is None:
                raise ValueError("A text prompt needs a tokenizer; none is loaded. Pass token ids instead.")
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=True))
            if not ids:
                raise ValueError(f"The prompt {prompt[:50]!r} tokenizes to zero tokens; the model needs at least one.")
            return ids
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("The prompt is an empty token list; give at least one token id.")
            return list(prompt)
        raise ValueError(f"The prompt must be a str or a list[int] of token ids, got {type(prompt).__name__}.")

    def _check_token_ids(self, what: str, ids: list[Any]) -> None:
        check_token_ids(what, ids, self.model_config.vocab_size)


def check_structured_outputs(so: StructuredOutputsParams) -> None:
    """The structured-output checks that need no grammar compiler (xgrammar lives in the engine process, which
    compiles the grammar and refuses the request if it does not compile): `ValueError` when one fails."""
    if so.json is not None:
        try:
            schema = json.loads(so.json) if isinstance(so.json, str) else json.loads(json.dumps(so.json))
        except (TypeError, ValueError) as e:  # not JSON text / not JSON-serializable
            raise ValueError(f"structured_outputs.json is not a valid JSON schema: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}.")
    if so.choice is not None and any(c == "" for c in so.choice):
        raise ValueError("structured_outputs.choice entries must be non-empty strings.")
    for name in ("regex", "grammar", "structural_tag"):
        if "\x00" in (getattr(so, name) or ""):
            raise ValueError(f"structured_outputs.{name} must not contain a NUL character.")
