"""The work one request may ask for is bounded before it is accepted (vx/serve/request_limits.py): the probes of
issue 32 against the session server (default limits) get a 400 naming the field and the `vx serve` option, at
once, and the server keeps answering; the counting itself is checked on the functions with small limits."""

from __future__ import annotations

import time

import pytest
from tests.support.server import MODEL

from vx.serve.errors import APIError
from vx.serve.options import ServerOptions
from vx.serve.protocol import CompletionRequest
from vx.serve.request_limits import (check_logprob_entries, check_prompt_count, check_request_tokens,
                                     check_sequences, check_stop_and_bad_words, prompt_count)

MESSAGES = [{"role": "user", "content": "Hi"}]


def _refused(response, param: str, option: str) -> str:
    """The error message of a 400 that names `param` and the flag of ServerOptions field `option`."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert f"--{option.replace('_', '-')}" in error["message"] and f"ServerOptions.{option}" in error["message"]
    return error["message"]


def test_20000_prompts_with_n_8_are_refused_at_once_and_the_server_keeps_answering(http):
    body = {"model": MODEL, "prompt": ["a"] * 20000, "n": 8, "max_tokens": 16}  # ~100 KB: 160,000 sequences
    start = time.monotonic()
    r = http.post("/v1/completions", json=body)
    elapsed = time.monotonic() - start
    message = _refused(r, "prompt", "max_prompts")
    assert "20000 entries" in message and str(ServerOptions().max_prompts) in message
    assert elapsed < 3, f"refusing took {elapsed:.1f} s: the prompts were processed first"
    assert http.get("/health").status_code == 200
    ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2


def test_prompts_times_n_and_n_itself_are_bounded(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ["a"] * 100, "n": 128, "max_tokens": 1})
    assert "12800 sequences" in _refused(r, "n", "max_sequences")
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "n": 129, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "max_n_sequences (128" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/chat/completions", {"messages": MESSAGES}),
])
def test_64_stop_strings_of_1_kib_are_a_400(http, path, body):
    r = http.post(path, json={"model": MODEL, **body, "n": 128, "max_tokens": 4, "stop": ["x" * 1024] * 64})
    assert "64 entries" in _refused(r, "stop", "max_stop_strings")
    r = http.post(path, json={"model": MODEL, **body, "max_tokens": 4, "stop": ["a", "x" * 1024]})
    assert "entry 1 is 1024 characters" in _refused(r, "stop", "max_stop_string_chars")
    r = http.post(path, json={"model": MODEL, **body, "max_tokens": 4, "bad_words": ["w"] * 1000})
    _refused(r, "bad_words", "max_bad_words")
    r = http.post(path, json={"model": MODEL, **body, "max_tokens": 4, "bad_words": ["w" * 1000]})
    _refused(r, "bad_words", "max_bad_word_chars")


def test_echo_and_logprobs_of_a_long_prompt_with_n_128_is_refused_before_it_runs(http):
    prompt = list(range(10, 410)) * 2  # 800 tokens of the session server's 1024
    body = {"model": MODEL, "prompt": prompt, "n": 128, "echo": True, "logprobs": 20, "max_tokens": 2}
    start = time.monotonic()
    r = http.post("/v1/completions", json=body)
    assert time.monotonic() - start < 3
    message = _refused(r, "logprobs", "max_logprob_entries")
    assert "x n=128" in message and str(ServerOptions().max_logprob_entries) in message
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "n": 128, "logprobs": True,
                                                "top_logprobs": 20})  # no max_tokens: the whole context counts
    _refused(r, "top_logprobs", "max_logprob_entries")
    ok = http.post("/v1/completions", json={**body, "n": 2})  # the same with two samples is fine
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["tokens"]) > 400


# ----------------------------------------------------------------------------------- the counting, with small limits
SMALL = ServerOptions(max_prompts=4, max_sequences=8, max_request_tokens=1000, max_logprob_entries=500,
                      max_stop_strings=2, max_stop_string_chars=5, max_bad_words=3, max_bad_word_chars=4)


def _param(call) -> str | None:
    with pytest.raises(APIError) as e:
        call()
    assert e.value.status == 400
    return e.value.param


def test_prompt_forms_are_counted_without_tokenizing():
    assert [prompt_count(p) for p in ("text", [1, 2, 3], ["a", "b"], [[1], [2], [3]], [])] == [1, 1, 2, 3, 0]
    check_prompt_count(4, SMALL)
    assert _param(lambda: check_prompt_count(5, SMALL, "input")) == "input"
    check_sequences(4, 2, SMALL, 128)
    assert _param(lambda: check_sequences(3, 3, SMALL, 128)) == "n"
    assert _param(lambda: check_sequences(1, 9, SMALL, None)) == "n"
    check_sequences(1, 0, SMALL, 128)  # not a count: SamplingParams refuses it, naming n
    assert _param(lambda: check_sequences(1, 129, ServerOptions(), 128)) == "n"


def test_tokens_count_the_prompts_and_n_times_what_each_may_generate():
    # 2 prompts of 100 tokens, n=4, max_tokens 100: 200 + 2 * 4 * 100 = 1000 (the limit)
    check_request_tokens([100, 100], 4, 100, 2048, SMALL, max_tokens_param="max_tokens")
    assert _param(lambda: check_request_tokens([100, 101], 4, 100, 2048, SMALL, max_tokens_param="max_tokens")) \
        == "max_tokens"
    # unset max_tokens: what the context leaves (300 - 100 = 200 a sample)
    check_request_tokens([100], 4, None, 300, SMALL, max_tokens_param="max_completion_tokens")
    assert _param(lambda: check_request_tokens([100], 5, None, 300, SMALL,
                                               max_tokens_param="max_completion_tokens")) == "max_completion_tokens"
    check_request_tokens([100], 4, 10**9, 300, SMALL, max_tokens_param="max_tokens")  # capped by the context


def test_logprob_entries_count_positions_times_logprobs_plus_one_times_n():
    # echo: (100 prompt + 24 generated) x (1 + 1) x 2 = 496 <= 500
    check_logprob_entries([100], 2, 24, 2048, SMALL, logprobs=1, echo=True, param="logprobs")
    assert _param(lambda: check_logprob_entries([100], 2, 26, 2048, SMALL, logprobs=1, echo=True,
                                                param="logprobs")) == "logprobs"
    check_logprob_entries([100], 2, 125, 2048, SMALL, logprobs=1, echo=False, param="logprobs")  # no echo: 500
    check_logprob_entries([100], 128, None, 2048, SMALL, logprobs=None, echo=True, param="logprobs")  # none asked
    check_logprob_entries([100], 2, 24, 2048, SMALL, logprobs=21, echo=True, param="logprobs")  # the field's own 400


def test_stop_strings_and_bad_words_by_count_and_length():
    def check(**fields):
        return check_stop_and_bad_words(CompletionRequest(prompt="x", **fields), SMALL)

    check(stop=["abcde", "b"], bad_words=["abcd", "b", "c"])
    check(stop="abcde")
    assert _param(lambda: check(stop="abcdef")) == "stop"
    assert _param(lambda: check(stop=["a", "b", "c"])) == "stop"
    assert _param(lambda: check(bad_words=["a", "b", "c", "d"])) == "bad_words"
    assert _param(lambda: check(bad_words=["abcde"])) == "bad_words"


def test_options_only_lower_the_bounds_sampling_params_sets():
    from vx import sampling_params as sp

    with pytest.raises(ValueError, match="max_stop_strings may be at most 32"):
        ServerOptions(max_stop_strings=sp.MAX_STOP_STRINGS + 1)
    with pytest.raises(ValueError, match="max_bad_word_chars"):
        ServerOptions(max_bad_word_chars=sp.MAX_BAD_WORD_CHARS + 1)
    with pytest.raises(ValueError, match="max_prompts must be a positive number"):
        ServerOptions(max_prompts=0)
    defaults = ServerOptions()
    assert (defaults.max_stop_strings, defaults.max_stop_string_chars, defaults.max_bad_words,
            defaults.max_bad_word_chars) == (sp.MAX_STOP_STRINGS, sp.MAX_STOP_STRING_CHARS, sp.MAX_BAD_WORDS,
                                             sp.MAX_BAD_WORD_CHARS)
    # n=128 of one prompt, a full context each on the default model (8192 tokens), stays within the defaults
    check_sequences(1, 128, defaults, 128)
    check_request_tokens([100], 128, None, 8192, defaults, max_tokens_param="max_tokens")
