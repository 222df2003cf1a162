"""Loading the Hugging Face tokenizer in the application's process, without pulling in torch where possible.

`AutoTokenizer` imports `transformers.configuration_utils`, which imports torch (seconds, hundreds of MB).
Most chat models ship a `tokenizer.json` whose declared class is the generic fast tokenizer; for those we
build that class directly, which `AutoTokenizer` would also pick, and torch stays out of the process.
Everything else goes through `AutoTokenizer` so that its model-specific fix-ups apply.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from vx.config import read_json

if TYPE_CHECKING:  # the real import is deferred: importing transformers costs about a second
    from transformers import PreTrainedTokenizerFast

# Declared classes that mean "just the tokenizer.json": loading them needs no model-specific code.
_GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model", "spiece.model")


def load_tokenizer(path: str | os.PathLike) -> "PreTrainedTokenizerFast":
    """Load the fast tokenizer stored in the local directory `path` (never the network).

    Raises `ValueError` when `path` is not a directory or holds no tokenizer files, or when loading fails.
    """
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.isdir(path):
        raise ValueError(f"Tokenizer path {path!r} is not a directory.")
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise ValueError(
            f"No tokenizer found in {path!r}: expected one of {', '.join(_TOKENIZER_FILES)}. "
            "Pass tokenizer='dir/with/tokenizer.json'."
        )
    config = read_json(os.path.join(path, "tokenizer_config.json"))
    try:
        if _is_generic(path, config):
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        else:
            from transformers import AutoTokenizer  # imports torch (through transformers' config code)

            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError ... here
        raise ValueError(f"Could not load the tokenizer in {path!r}: {type(e).__name__}: {e}") from e
    if getattr(tok, "_tokenizer", None) is None:
        # Incremental detokenization steps the Rust backend directly; a slow tokenizer has none.
        raise ValueError(f"The tokenizer in {path!r} is not a fast (tokenizers-backed) tokenizer.")
    return tok


def _is_generic(path: str, config: dict[str, Any]) -> bool:
    """True when the directory holds a tokenizer.json declared as the generic class (no custom code)."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")) or "auto_map" in config:
        return False
    return config.get("tokenizer_class") in _GENERIC_CLASSES


def eos_token_ids(tokenizer: Any, extra: list[int] | None = None) -> list[int]:
    """`extra` (e.g. the model config's eos ids) followed by the tokenizer's eos id, deduplicated, in order."""
    ids: list[int] = []
    candidates = list(extra or []) + [getattr(tokenizer, "eos_token_id", None)]
    for t in candidates:
        if isinstance(t, int) and not isinstance(t, bool) and t not in ids:
            ids.append(t)
    return ids


def special_token_ids(tokenizer: Any) -> set[int]:
    """Every special token id of the tokenizer (eos, bos, pad, chat markers ...)."""
    return {int(i) for i in getattr(tokenizer, "all_special_ids", []) if i is not None}
