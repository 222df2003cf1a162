"""Reasoning output: the `<think>...</think>` block of a thinking model goes to `reasoning_content`, the rest to
`content` (vLLM's `--reasoning-parser`, for DeepSeek-R1 and Qwen3 style models).

Parsers (`REASONING_PARSERS`): "deepseek_r1" reads the reply as reasoning from its first token up to `</think>`
(its template opens the block in the prompt; a leading `<think>` written by the model is dropped too). "qwen3"
reads a block only when the reply opens with `<think>`, or when the rendered prompt ends with one (templates that
open it for the model); so Qwen3 with `chat_template_kwargs: {"enable_thinking": false}`, whose template writes an
empty block into the prompt, answers in plain content. Either way, `enable_thinking: false` (or `thinking:
false`) in the request's `chat_template_kwargs` turns the parser off for that request. A reply held to an output
constraint from its first token (a JSON schema, JSON object or choice) has a block only if it opens with
`<think>`.
"""

from __future__ import annotations

from typing import Any

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def reasoning_enabled(parser: str | None, chat_template_kwargs: dict[str, Any] | None) -> bool:
    """Whether a request's reply is read for reasoning: a parser is set and the request did not turn thinking off."""
    kwargs = chat_template_kwargs or {}
    return parser is not None and kwargs.get("enable_thinking", True) is not False \
        and kwargs.get("thinking", True) is not False


def starts_inside(parser: str, prompt_opened: bool, constrained: bool) -> bool:
    """Whether a reply starts inside the think block: the prompt opened it, or the parser says replies always do
    (deepseek_r1); never for a reply an output constraint holds from its first token (its grammar has no block)."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"Unknown reasoning parser {parser!r}; known: {', '.join(REASONING_PARSERS)}.")
    return not constrained and (prompt_opened or parser == "deepseek_r1")


class ReasoningSplitter:
    """Splits one reply, fed as it streams, into reasoning and content; holds back only what may be part of a tag.

    With `inside`, the reply starts inside the think block (`starts_inside`); a leading `<think>` opens it anyway.
    """

    def __init__(self, inside: bool = False) -> None:
        self.starts_inside = inside
        self.state = "start"  # "start": the reply may still open with <think>; then "reasoning", then "content"
        self.pending = ""
        self.content_started = False  # the whitespace between </think> and the answer is dropped

    def feed(self, delta: str) -> tuple[str, str]:
        """Add generated text; return the (reasoning, content) that can be sent now."""
        self.pending += delta
        reasoning = content = ""
        if self.state == "start":
            head = self.pending.lstrip()
            if head.startswith(THINK_OPEN):
                self.pending, self.state = head[len(THINK_OPEN):], "reasoning"
            elif THINK_OPEN.startswith(head):
                return "", ""  # may still be the tag
            else:
                self.state = "reasoning" if self.starts_inside else "content"
        if self.state == "reasoning":
            end = self.pending.find(THINK_CLOSE)
            if end < 0:
                keep = _partial_tag_length(self.pending, THINK_CLOSE)
                reasoning, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
                return reasoning, ""
            reasoning, self.pending = self.pending[:end], self.pending[end + len(THINK_CLOSE):]
            self.state = "content"
        content, self.pending = self.pending, ""
        if not self.content_started:
            content = content.lstrip()
            self.content_started = bool(content)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """At the end of the reply: the (reasoning, content) still held back."""
        rest, self.pending = self.pending, ""
        if self.state == "reasoning" or (self.state == "start" and self.starts_inside):
            return rest, ""
        return "", rest if self.content_started else rest.lstrip()

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole reply as (reasoning_content, content), None for an empty part."""
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.finish()
        return reasoning + more_reasoning or None, content + more_content or None


def _partial_tag_length(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
