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


def check_prompt_length(num_tokens: int, max_model_len: int | None, param: str) -> None:
    """A 400 for a prompt that leaves no room for one generated token (the engine's own rule)."""
    if max_model_len is not None and num_tokens >= max_model_len:
        raise bad_request(f"The prompt is {num_tokens} tokens long, but max_model_len is {max_model_len}: the "
                          "prompt plus at least one generated token must fit, so the prompt may have at most "
                          f"{max_model_len - 1} tokens.", param)


def encode_prompt(tokenizer: Any, text: str, *, add_special_tokens: bool, max_model_len: int | None,
                  param: str) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=...)`, refused (a 400 naming `param`) when too long for
    `max_model_len`. Blocking: call it in a worker thread (`in_thread`).

    For a plain fast tokenizer the Rust backend is called directly, as `encode` would call it, but without
    offsets (2-3x faster) and without transformers' Python-side conversion, which holds the GIL for ~0.2 s per
    million tokens; the length is checked before any ids are converted.
    """
    backend = _plain_backend(tokenizer)
    if backend is None:
        ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        check_prompt_length(len(ids), max_model_len, param)
        return ids
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    encoding = encode([text], add_special_tokens=add_special_tokens)[0]
    check_prompt_length(len(encoding), max_model_len, param)
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
