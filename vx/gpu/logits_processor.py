"""Logits processors: the per-request SamplingParams that change logits before temperature, over a whole batch.

Each processor edits a float32 [B, V] logits tensor in place, with a few tensor operations for the whole batch.
The only Python work per step is building small index tensors from the requests' token lists (which rows ban
which token ids, the padded token lists the penalties count). The order is vLLM's: bad words, min tokens,
logit bias, then the penalties (repetition over prompt + output tokens, then frequency and presence over the
output tokens). Greedy rows are processed too: penalties change which token is the argmax, as in vLLM.

`build_logits_processors` returns None when no row uses any of them, so a default batch runs nothing here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from vx.sampling_params import SamplingParams


class LogitsProcessor(ABC):
    """Edits a batch of logits [B, V] (float32) in place and returns it."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor: ...

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.apply(logits)


def _ban(logits: torch.Tensor, rows: list[int], cols: list[int]) -> torch.Tensor:
    """logits[rows[j], cols[j]] = -inf for every j, in one indexed write."""
    if rows:
        dev = logits.device
        logits.index_put_((torch.tensor(rows, dtype=torch.int64, device=dev),
                           torch.tensor(cols, dtype=torch.int64, device=dev)),
                          torch.tensor(float("-inf"), dtype=logits.dtype, device=dev))
    return logits


class BadWordsLogitsProcessor(LogitsProcessor):
    """Bans the last token of each bad word (a token-id list) whose other tokens end the row's output so far.

    A single-token bad word is always banned. Matching looks at the generated tokens only, as vLLM does.
    """

    def __init__(self, bad_words_token_ids: Sequence[Sequence[Sequence[int]] | None],
                 output_token_ids: Sequence[Sequence[int]]) -> None:
        rows: list[int] = []
        cols: list[int] = []
        for i, (words, out) in enumerate(zip(bad_words_token_ids, output_token_ids)):
            if not words:
                continue
            n_out = len(out)
            for word in words:
                k = len(word) - 1  # prefix length
                if k > n_out:
                    continue
                if k == 0 or list(out[n_out - k:]) == list(word[:k]):
                    rows.append(i)
                    cols.append(word[-1])
        self.rows, self.cols = rows, cols

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return _ban(logits, self.rows, self.cols)


class MinTokensLogitsProcessor(LogitsProcessor):
    """While a row has generated fewer than `min_tokens` tokens, its stop token ids (EOS unless `ignore_eos`,
    and `stop_token_ids`) get -inf."""

    def __init__(self, params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]],
                 eos_token_ids: Sequence[Sequence[int]]) -> None:
        rows: list[int] = []
        cols: list[int] = []
        for i, (p, out, eos) in enumerate(zip(params, output_token_ids, eos_token_ids)):
            if len(out) >= p.min_tokens:
                continue
            stop = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                stop.update(eos)
            for t in sorted(stop):
                rows.append(i)
                cols.append(t)
        self.rows, self.cols = rows, cols

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return _ban(logits, self.rows, self.cols)


class LogitBiasLogitsProcessor(LogitsProcessor):
    """Adds each row's `logit_bias[token]` to its logit of `token`."""

    def __init__(self, params: Sequence[SamplingParams]) -> None:
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        for i, p in enumerate(params):
            for t, b in (p.logit_bias or {}).items():
                self.rows.append(i)
                self.cols.append(int(t))
                self.vals.append(float(b))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.rows:
            dev = logits.device
            logits.index_put_((torch.tensor(self.rows, dtype=torch.int64, device=dev),
                               torch.tensor(self.cols, dtype=torch.int64, device=dev)),
                              torch.tensor(self.vals, dtype=logits.dtype, device=dev), accumulate=True)
        return logits


def _padded(token_lists: Sequence[Sequence[int]], pad: int, device: torch.device | str) -> torch.Tensor:
    """int64 [B, max_len] of the lists, each padded with `pad`."""
    width = max((len(t) for t in token_lists), default=0)
    rows = [list(t) + [pad] * (width - len(t)) for t in token_lists]
    return torch.tensor(rows, dtype=torch.int64, device=device).reshape(len(token_lists), width)


class RepetitionPenaltyLogitsProcessor(LogitsProcessor):
    """For every token in the row's prompt or output: logit < 0 ? logit * p : logit / p (HF / vLLM semantics).

    Works on the [B, L] logits of the rows' tokens (gather, penalise, scatter back), not on all [B, V]: a token
    that occurs twice is gathered twice and written back twice with the same value, so it is penalised once.
    """

    def __init__(self, params: Sequence[SamplingParams], prompt_token_ids: Sequence[Sequence[int]],
                 output_token_ids: Sequence[Sequence[int]]) -> None:
        self.penalty = [float(p.repetition_penalty) for p in params]
        # Rows without a penalty contribute no tokens (their factor is 1 anyway).
        self.tokens = [list(pr) + list(out) if p.repetition_penalty != 1.0 else []
                       for p, pr, out in zip(params, prompt_token_ids, output_token_ids)]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        dev = logits.device
        # Pad each row with one of its own tokens (0 for an empty row, whose factor is 1): padding then rewrites
        # a value that is written anyway, never another token's.
        width = max((len(t) for t in self.tokens), default=0)
        rows = [t + [t[0] if t else 0] * (width - len(t)) for t in self.tokens]
        toks = torch.tensor(rows, dtype=torch.int64, device=dev).reshape(len(rows), width)
        penalty = torch.tensor(self.penalty, dtype=logits.dtype, device=dev).unsqueeze(1)
        picked = logits.gather(1, toks)
        picked = torch.where(picked < 0, picked * penalty, picked / penalty)
        return logits.scatter_(1, toks, picked)


class FrequencyPresencePenaltyLogitsProcessor(LogitsProcessor):
    """logit -= frequency_penalty * count + presence_penalty * (count > 0), counting the row's output tokens
    (OpenAI semantics).

    Works on the [B, L] output tokens: each occurrence subtracts the frequency penalty (scatter-add), and the
    first occurrence of each distinct token (found by sorting the row) also subtracts the presence penalty.
    """

    def __init__(self, params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]]) -> None:
        self.freq = [float(p.frequency_penalty) for p in params]
        self.pres = [float(p.presence_penalty) for p in params]
        self.tokens = [list(out) if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) else []
                       for p, out in zip(params, output_token_ids)]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        dev = logits.device
        vocab = logits.shape[1]
        # Pad with `vocab`, which sorts after every real token; padded places get weight 0 (at index vocab - 1).
        toks, _ = _padded(self.tokens, vocab, dev).sort(dim=1)
        if toks.shape[1] == 0:
            return logits
        valid = toks < vocab
        first = valid.clone()
        first[:, 1:] &= toks[:, 1:] != toks[:, :-1]
        fp = torch.tensor([self.freq, self.pres], dtype=logits.dtype, device=dev)
        delta = fp[0].unsqueeze(1) * valid.to(logits.dtype) + fp[1].unsqueeze(1) * first.to(logits.dtype)
        return logits.scatter_add_(1, toks.clamp_(max=vocab - 1), -delta)


class LogitsProcessorChain(LogitsProcessor):
    """Processors applied one after the other."""

    def __init__(self, processors: list[LogitsProcessor]) -> None:
        self.processors = processors

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for proc in self.processors:
            logits = proc.apply(logits)
        return logits


def needs_logits_processing(p: SamplingParams, has_bad_words: bool = False) -> bool:
    """Whether a request uses any processor here (min_tokens counts even if it is already satisfied)."""
    return (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
            or bool(p.logit_bias) or p.min_tokens > 0 or has_bad_words)


def build_logits_processors(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    prompt_token_ids: Sequence[Sequence[int]] | None = None,
    eos_token_ids: Sequence[Sequence[int]] | None = None,
    bad_words_token_ids: Sequence[Sequence[Sequence[int]] | None] | None = None,
) -> LogitsProcessorChain | None:
    """The chain the rows need this step (one entry per row in every list), or None when no row needs any."""
    n = len(params)
    bad = bad_words_token_ids if bad_words_token_ids is not None else [None] * n
    if not any(needs_logits_processing(p, bool(b)) for p, b in zip(params, bad)):
        return None  # the fast path: one cheap pass over the rows' params
    prompts = prompt_token_ids if prompt_token_ids is not None else [[]] * n
    eos = eos_token_ids if eos_token_ids is not None else [()] * n
    procs: list[LogitsProcessor] = []
    if any(bad):
        procs.append(BadWordsLogitsProcessor(bad, output_token_ids))
    if any(p.min_tokens > len(out) for p, out in zip(params, output_token_ids)):
        proc = MinTokensLogitsProcessor(params, output_token_ids, eos)
        if proc.rows:
            procs.append(proc)
    if any(p.logit_bias for p in params):
        procs.append(LogitBiasLogitsProcessor(params))
    if any(p.repetition_penalty != 1.0 for p in params):
        procs.append(RepetitionPenaltyLogitsProcessor(params, prompts, output_token_ids))
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        procs.append(FrequencyPresencePenaltyLogitsProcessor(params, output_token_ids))
    return LogitsProcessorChain(procs) if procs else None
