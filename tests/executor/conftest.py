"""The whole model's outputs, the reference of every split (tests/support/parallel_runs.py)."""

from __future__ import annotations

import pytest

from tests.support.parallel_runs import run


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    """The engine families' tiny models, and a Llama with tied embeddings (its LM head on the last stage loads the
    first stage's table)."""
    from tests.support.tiny_models import make_tiny_model
    from tests.support.tiny_tokenizer import make_tiny_tokenizer

    tied = str(tmp_path_factory.mktemp("tiny-llama3_tied"))
    make_tiny_model("llama3_tied", tied, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    make_tiny_tokenizer(tied)
    return {**tiny_model_dirs, "llama3_tied": tied}


@pytest.fixture(scope="module")
def whole_model(model_dirs):
    """family -> the one-process engine's outputs (computed when first asked for)."""
    cache: dict[str, list] = {}

    def get(family: str) -> list:
        if family not in cache:
            cache[family] = run(model_dirs[family])[0]
        return cache[family]

    return get
