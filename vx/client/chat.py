"""Chat: render messages with the model's chat template, and stop at its end-of-turn token."""

from __future__ import annotations

from typing import Any, Sequence

from vx.sampling_params import SamplingParams

DEFAULT_CHAT_MAX_TOKENS = 512
"""`max_tokens` of a chat reply when the caller gives no SamplingParams."""

# End-of-turn markers of common chat templates, used when they differ from the tokenizer's eos.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

Message = dict[str, Any]


def validate_messages(messages: Any) -> list[Message]:
    """Check the OpenAI-style message list: a non-empty list of {"role": str, "content": str|None}."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts.")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}.")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"messages[{i}] needs a non-empty string 'role'.")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"messages[{i}]['content'] must be a string, got {type(content).__name__}.")
    return list(messages)


def render_chat_prompt(tokenizer: Any, messages: Sequence[Message], *, tools: list[dict] | None = None,
                       add_generation_prompt: bool = True, chat_template: str | None = None) -> str:
    """The prompt text for `messages` under the tokenizer's (or the given) chat template."""
    messages = validate_messages(messages)
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("This model's tokenizer has no chat template; pass chat_template=... or use "
                         "generate() with a plain prompt.")
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
    if tools:
        kwargs["tools"] = tools
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    try:
        return tokenizer.apply_chat_template(list(messages), **kwargs)
    except Exception as e:  # jinja errors from the template itself
        raise ValueError(f"The chat template failed on these messages: {e}") from e


def end_of_turn_token_ids(tokenizer: Any, chat_template: str | None = None) -> list[int]:
    """Token ids that end an assistant turn in this template (besides the tokenizer's eos)."""
    template = chat_template or getattr(tokenizer, "chat_template", None) or ""
    ids = []
    for tok in _END_OF_TURN_TOKENS:
        if tok in template:
            tid = tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None) and tid not in ids:
                ids.append(tid)
    return ids


def chat_sampling_params(params: SamplingParams | None, tokenizer: Any,
                         chat_template: str | None = None) -> SamplingParams:
    """The caller's params (or chat defaults) plus the template's end-of-turn tokens as stop tokens."""
    if params is None:
        params = SamplingParams(max_tokens=DEFAULT_CHAT_MAX_TOKENS, temperature=0.7, top_p=0.95)
    elif not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}.")
    eot = end_of_turn_token_ids(tokenizer, chat_template)
    if not eot or params.ignore_eos:
        return params
    stop_ids = list(params.stop_token_ids or [])
    stop_ids += [t for t in eot if t not in stop_ids]
    return params.clone(stop_token_ids=stop_ids)
