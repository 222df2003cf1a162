"""vx/serve/logprobs.py: a token masked out (a grammar, a logit bias) has logprob -inf, which JSON cannot carry: both
OpenAI shapes send vLLM's stand-in, -9999.0, so every response stays valid JSON numbers (the fuzzer found nulls)."""

from __future__ import annotations

import json
import math

from vx.outputs import Logprob
from vx.serve.logprobs import LOGPROB_FLOOR, append_completion_logprobs, chat_logprobs
from vx.serve.protocol import CompletionLogprobs


class _Tokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


# Token 1 was sampled (the grammar allowed only tokens 1 and 2); 3 and 4 were masked out.
POSITION = {1: Logprob(-0.1, 1), 2: Logprob(-2.3, 2), 3: Logprob(-math.inf, 3), 4: Logprob(-math.inf, 4)}


def _numbers(value: object) -> list[float]:
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return [value] if isinstance(value, float) or value is None else []


def test_completion_logprobs_of_masked_tokens_are_the_floor_not_null():
    out = CompletionLogprobs()
    append_completion_logprobs(out, _Tokenizer(), [1], [POSITION], 0)
    body = json.loads(out.model_dump_json())
    assert body["token_logprobs"] == [-0.1]
    assert body["top_logprobs"] == [{"<1>": -0.1, "<2>": -2.3, "<3>": LOGPROB_FLOOR, "<4>": LOGPROB_FLOOR}]
    assert None not in _numbers(body)


def test_chat_logprobs_of_masked_tokens_are_the_floor():
    [entry] = chat_logprobs(_Tokenizer(), [1], [POSITION], top_n=4)
    body = json.loads(entry.model_dump_json())
    assert body["logprob"] == -0.1
    assert [t["logprob"] for t in body["top_logprobs"]] == [-0.1, -2.3, LOGPROB_FLOOR, LOGPROB_FLOOR]


class _SharedTextTokenizer:
    """Tokens 5 and 6 decode to the same text (byte-level vocabularies have such pairs)."""

    def decode(self, ids: list[int]) -> str:
        return "".join("x" if i in (5, 6) else f"<{i}>" for i in ids)


def test_the_chosen_tokens_logprob_is_its_texts_top_entry_when_another_token_shares_the_text():
    # Token 5 was sampled; token 6, ranked below it, has the same text.
    position = {5: Logprob(-1.0, 1), 6: Logprob(-1.5, 2), 7: Logprob(-2.0, 3)}
    out = CompletionLogprobs()
    append_completion_logprobs(out, _SharedTextTokenizer(), [5], [position], 0)
    assert out.tokens == ["x"] and out.token_logprobs == [-1.0]
    assert out.top_logprobs == [{"x": -1.0, "<7>": -2.0}]
