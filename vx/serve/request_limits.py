"""The work one generation request may ask for, checked before it costs anything: a 400 naming the field and the
`vx serve` option (a `ServerOptions` field) that bounds it.

Checked on the request as sent, before any prompt is tokenized: the number of prompts (`--max-prompts`), prompts
times `n` (`--max-sequences`, and `n` against the engine's `max_n_sequences`), stop strings and bad words by count
and length. Checked once the prompts' lengths are known: the tokens the request may make the engine hold and
produce (`--max-request-tokens`) and the log-probabilities its response may carry (`--max-logprob-entries`).
The stop-string and bad-word options only lower `vx.SamplingParams`' own bounds, which hold for every caller.
"""

from __future__ import annotations

from typing import Any, Sequence

from vx.sampling_params import MAX_LOGPROBS
from vx.serve.errors import APIError, bad_request
from vx.serve.options import ServerOptions
from vx.serve.protocol import SamplingFields


def prompt_count(prompt: Any) -> int:
    """How many prompts OpenAI's prompt forms (str, [str], [int], [[int]]) hold, without tokenizing them."""
    if isinstance(prompt, str) or not isinstance(prompt, list):
        return 1
    if prompt and all(isinstance(p, int) for p in prompt):
        return 1  # one prompt given as token ids
    return len(prompt)


def check_prompt_count(num_prompts: int, options: ServerOptions, param: str = "prompt") -> None:
    """A 400 for more prompts (or embedding inputs) than `--max-prompts`: each is an engine request."""
    if num_prompts > options.max_prompts:
        raise _over(f"{param} has {num_prompts} entries; this server accepts at most {options.max_prompts}",
                    "max_prompts", param)


def check_sequences(num_prompts: int, n: int, options: ServerOptions, max_n_sequences: int | None) -> None:
    """A 400 for `n` above the engine's `max_n_sequences`, or prompts x `n` above `--max-sequences`: found here,
    before the server sets up a choice for each."""
    if isinstance(n, int) and max_n_sequences is not None and n > max_n_sequences:
        raise bad_request(f"n={n} exceeds the engine's max_n_sequences ({max_n_sequences}, --max-n-sequences), the "
                          "most samples one request may ask for.", "n")
    if isinstance(n, int) and n > 0 and num_prompts * n > options.max_sequences:
        raise _over(f"{num_prompts} prompt(s) x n={n} make {num_prompts * n} sequences; this server accepts at "
                    f"most {options.max_sequences} in one request", "max_sequences", "n" if n > 1 else "prompt")


def check_stop_and_bad_words(req: SamplingFields, options: ServerOptions) -> None:
    """A 400 for more or longer `stop` strings or `bad_words` than the server's options allow."""
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    _check_strings("stop", stop, options.max_stop_strings, "max_stop_strings", options.max_stop_string_chars,
                   "max_stop_string_chars")
    _check_strings("bad_words", req.bad_words, options.max_bad_words, "max_bad_words", options.max_bad_word_chars,
                   "max_bad_word_chars")


def check_request_tokens(prompt_lengths: Sequence[int], n: int, max_tokens: int | None, max_model_len: int | None,
                         options: ServerOptions, *, max_tokens_param: str) -> None:
    """A 400 when the prompts plus `n` x `max_tokens` each (unset: the room the context leaves) pass
    `--max-request-tokens`."""
    total = sum(length + n * _generated(length, max_tokens, max_model_len) for length in prompt_lengths)
    if total > options.max_request_tokens:
        raise _over(f"the request asks for up to {total} tokens (its prompts, plus n={n} x {max_tokens_param}="
                    f"{max_tokens if max_tokens is not None else 'the rest of the context'} for each); this server "
                    f"accepts at most {options.max_request_tokens}; lower {max_tokens_param} or n",
                    "max_request_tokens", max_tokens_param)


def check_logprob_entries(prompt_lengths: Sequence[int], n: int, max_tokens: int | None, max_model_len: int | None,
                          options: ServerOptions, *, logprobs: int | None, echo: bool, param: str) -> None:
    """A 400 when the response may carry more log-probabilities than `--max-logprob-entries`: each of the n
    samples of each prompt has (logprobs + 1) per generated token, and per prompt token when echoed."""
    if logprobs is None or not 0 <= logprobs <= MAX_LOGPROBS:
        return  # none asked for, or a value the field's own check refuses
    positions = sum((length if echo else 0) + _generated(length, max_tokens, max_model_len)
                    for length in prompt_lengths)
    total = positions * (logprobs + 1) * n
    if total > options.max_logprob_entries:
        raise _over(f"{param}={logprobs} over {positions} position(s) x n={n} make {total} log-probabilities in "
                    f"the response; this server sends at most {options.max_logprob_entries}; lower {param}, n "
                    "or max_tokens" + (", or leave out echo" if echo else ""), "max_logprob_entries", param)


def _generated(prompt_length: int, max_tokens: int | None, max_model_len: int | None) -> int:
    """The most tokens a sample of this prompt may generate: max_tokens, within what the context leaves."""
    room = max_model_len - prompt_length if max_model_len is not None else None
    if max_tokens is None:
        return max(room or 0, 0)
    return max(min(max_tokens, room), 0) if room is not None else max(max_tokens, 0)


def _check_strings(param: str, values: list[str] | None, most: int, most_option: str, longest: int,
                   longest_option: str) -> None:
    if not values:
        return
    if len(values) > most:
        raise _over(f"{param} has {len(values)} entries; this server accepts at most {most}", most_option, param)
    for i, value in enumerate(values):
        if isinstance(value, str) and len(value) > longest:
            raise _over(f"{param} entry {i} is {len(value)} characters long; this server accepts at most {longest}",
                        longest_option, param)


def _over(what: str, option: str, param: str) -> APIError:
    """The 400 for a request over option `option`, naming the request field `param` and the flag."""
    return bad_request(f"{what} (--{option.replace('_', '-')}, ServerOptions.{option}).", param)
