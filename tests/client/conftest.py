"""Fixtures for the client-side tests: the tiny tokenizer (built once) and a model config without a model."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from vx.config import ModelConfig

TINY_MODEL_VOCAB = 512  # what the lead's tiny random models use; the tokenizer's vocab is smaller


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> str:
    """A directory holding only the tiny byte-level BPE tokenizer."""
    from tests.support.tiny_tokenizer import make_tiny_tokenizer

    d = tmp_path_factory.mktemp("tiny-tokenizer")
    make_tiny_tokenizer(str(d))
    return str(d)


@pytest.fixture(scope="session")
def tokenizer(tiny_tokenizer_dir) -> Any:
    """The tiny tokenizer, loaded the way the client loads any tokenizer."""
    from vx.client.tokenizer import load_tokenizer

    return load_tokenizer(tiny_tokenizer_dir)


@pytest.fixture
def make_model_config(tiny_tokenizer_dir) -> Callable[..., ModelConfig]:
    """Build a `ModelConfig` for the Processor (no weights or HF config needed on the client side)."""

    def make(max_model_len: int = 64, vocab_size: int = TINY_MODEL_VOCAB, eos_token_ids=(0,)) -> ModelConfig:
        return ModelConfig(
            model=tiny_tokenizer_dir,
            tokenizer=tiny_tokenizer_dir,
            hf_config=None,
            architecture="Qwen3ForCausalLM",
            dtype="float32",
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            eos_token_ids=list(eos_token_ids),
        )

    return make
