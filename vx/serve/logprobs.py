"""vx's per-token logprobs (`list[dict[token id, vx.Logprob]]`) in OpenAI's two shapes.

Completions: parallel lists `tokens`, `token_logprobs`, `top_logprobs` (token text -> logprob) and
`text_offset`. Chat: `content`, one `{token, logprob, bytes, top_logprobs}` per generated token.
"""

from __future__ import annotations

from typing import Any, Sequence

from vx.outputs import Logprob
from vx.serve.protocol import CompletionLogprobs, TokenLogprob, TopLogprob

Positions = Sequence[dict[int, Logprob] | None]

# JSON has no -inf: a token masked out (by a grammar, a logit bias, a bad word) gets this stand-in, as vLLM sends.
LOGPROB_FLOOR = -9999.0


def _json_logprob(logprob: float) -> float:
    """`logprob` as a JSON number: -inf (and NaN, which should not occur) become LOGPROB_FLOOR."""
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


def _token_text(tokenizer: Any, token_id: int, lp: Logprob | None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id])


def append_completion_logprobs(out: CompletionLogprobs, tokenizer: Any, token_ids: Sequence[int],
                               positions: Positions | None, offset: int) -> int:
    """Append one entry per token to `out` (positions missing or None give null logprobs, as for the first
    prompt token); return the text offset after the last token."""
    for i, tid in enumerate(token_ids):
        pos = positions[i] if positions is not None and i < len(positions) else None
        chosen = pos.get(tid) if pos else None
        text = _token_text(tokenizer, tid, chosen)
        out.tokens.append(text)
        out.token_logprobs.append(_json_logprob(chosen.logprob) if chosen is not None else None)
        top = {_token_text(tokenizer, t, lp): _json_logprob(lp.logprob) for t, lp in _by_rank(pos)} if pos else None
        if top is not None and chosen is not None:
            # Two tokens can share a text (a dict keyed by text keeps one): the chosen token's own entry wins, so
            # that top_logprobs[tokens[i]] is token_logprobs[i].
            top[text] = _json_logprob(chosen.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return offset


def chat_logprobs(tokenizer: Any, token_ids: Sequence[int], positions: Positions | None,
                  top_n: int) -> list[TokenLogprob]:
    """One entry per generated token with its `top_n` most likely alternatives."""
    entries = []
    for i, tid in enumerate(token_ids):
        pos = positions[i] if positions is not None and i < len(positions) else None
        chosen = pos.get(tid) if pos else None
        text = _token_text(tokenizer, tid, chosen)
        top = [_top(tokenizer, t, lp) for t, lp in _by_rank(pos)[:top_n]] if pos and top_n else []
        # A token the engine gave no logprob for (it should not happen) gets -inf's JSON stand-in.
        entries.append(TokenLogprob(token=text, logprob=_json_logprob(chosen.logprob if chosen is not None
                                                                       else float("-inf")),
                                    bytes=list(text.encode("utf-8")), top_logprobs=top))
    return entries


def _top(tokenizer: Any, token_id: int, lp: Logprob) -> TopLogprob:
    text = _token_text(tokenizer, token_id, lp)
    return TopLogprob(token=text, logprob=_json_logprob(lp.logprob), bytes=list(text.encode("utf-8")))


def _by_rank(pos: dict[int, Logprob] | None) -> list[tuple[int, Logprob]]:
    """The position's entries, most likely first."""
    if not pos:
        return []
    return sorted(pos.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30, -kv[1].logprob))
