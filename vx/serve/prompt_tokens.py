"""Prompt text -> token ids in worker threads, so that megabytes of text never stall the server's event loop.

The Hugging Face fast tokenizer is Rust and releases the GIL while it encodes (5 MB of text: seconds of work).
Concurrent encodes without truncation or padding reconfigure nothing, only read it, so the threads share one
tokenizer with each other and with the event loop's detokenizing. A prompt too long for the model is refused in
the thread too: the engine front end would otherwise check its millions of ids on the event loop (~0.2 µs each)
before finding it too long.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import anyio

from vx.serve.errors import bad_request

TOKENIZE_THREADS = 4  # prompts tokenized at once: each keeps a core busy
T = TypeVar("T")


def new_tokenize_limiter() -> anyio.CapacityLimiter:
    """The limiter of one server's tokenizing threads."""
    return anyio.CapacityLimiter(TOKENIZE_THREADS)


async def in_thread(fn: Callable[[], T], limiter: anyio.CapacityLimiter | None) -> T:
    """`fn()` in a worker thread under `limiter` (tokenizing is bounded work: it is not abandoned on cancel)."""
    return await anyio.to_thread.run_sync(fn, limiter=limiter)


def check_prompt_length(num_tokens: int, max_model_len: int | None, param: str, generates: bool = True) -> None:
    """A 400 for a prompt that leaves no room for one generated token (the engine's own rule), or, for an input
    that generates nothing (`generates=False`: an embedding's), one longer than max_model_len."""
    if max_model_len is None:
        return
    if generates and num_tokens >= max_model_len:
        raise bad_request(f"The prompt is {num_tokens} tokens long, but max_model_len is {max_model_len}: the "
                          "prompt plus at least one generated token must fit, so the prompt may have at most "
                          f"{max_model_len - 1} tokens.", param)
    if not generates and num_tokens > max_model_len:
        raise bad_request(f"The {param} is {num_tokens} tokens long, but max_model_len is {max_model_len}: it may "
                          f"have at most {max_model_len} tokens.", param)


def tokenize_prompts(prompt: Any, tokenizer: Any, max_model_len: int | None, *, param: str = "prompt",
                     generates: bool = True) -> tuple[list[str | None], list[list[int]]]:
    """OpenAI's four prompt forms (str, [str], [int], [[int]]) as (texts, token ids); text is tokenized here, with
    the model's special tokens (e.g. BOS), as a text prompt to vx.AsyncLLM would be. A 400 naming `param` for an
    empty or too long one (`check_prompt_length`). Blocking: call it in a worker thread (`in_thread`): megabytes of
    text take seconds."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items:
        raise bad_request(f"{param} must not be empty.", param)
    texts: list[str | None] = []
    ids: list[list[int]] = []
    for i, p in enumerate(items):
        if isinstance(p, str):
            if not p:
                raise bad_request(f"{param} {i} is empty.", param)
            texts.append(p)
            ids.append(encode_prompt(tokenizer, p, add_special_tokens=True, max_model_len=max_model_len,
                                     param=param, generates=generates))
        else:
            if not p:
                raise bad_request(f"{param} {i} is an empty token list.", param)
            texts.append(None)
            ids.append(list(p))
            check_prompt_length(len(p), max_model_len, param, generates)
    return texts, ids


def encode_prompt(tokenizer: Any, text: str, *, add_special_tokens: bool, max_model_len: int | None,
                  param: str, generates: bool = True) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=...)`, refused (a 400 naming `param`) when too long for
    `max_model_len` (`check_prompt_length`). Blocking: call it in a worker thread (`in_thread`).

    For a plain fast tokenizer the Rust backend is called directly, as `encode` would call it, but without
    offsets (2-3x faster) and without transformers' Python-side conversion, which holds the GIL for ~0.2 s per
    million tokens; the length is checked before any ids are converted.
    """
    backend = _plain_backend(tokenizer)
    if backend is None:
        ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        check_prompt_length(len(ids), max_model_len, param, generates)
        return ids
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    encoding = encode([text], add_special_tokens=add_special_tokens)[0]
    check_prompt_length(len(encoding), max_model_len, param, generates)
    return encoding.ids


def _plain_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer behind `tokenizer` when its `encode` is transformers' own, unchanged; else None."""
    from transformers import PreTrainedTokenizerFast

    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    cls = type(tokenizer)
    for name in ("encode", "_encode_plus", "_batch_encode_plus"):  # e.g. CodeLlama's fill-in-the-middle
        if getattr(cls, name, None) is not getattr(PreTrainedTokenizerFast, name, None):
            return None
    # transformers syncs this flag into the backend on each call; while they differ, let it do so.
    split = bool(getattr(tokenizer, "split_special_tokens", False))
    if bool(getattr(backend, "encode_special_tokens", False)) != split:
        return None
    return backend
