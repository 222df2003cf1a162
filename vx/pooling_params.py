"""Per-request pooling controls for embeddings, alongside `SamplingParams` (vLLM's `PoolingParams`).

A request with `PoolingParams` runs its prompt through the scheduler like any other, and finishes after its prompt
with one pooled vector of the final hidden states (after the model's last norm) instead of a generated token.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

PoolingType = Literal["last", "mean"]
POOLING_TYPES: tuple[str, ...] = ("last", "mean")


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to pool one request's hidden states into an embedding. Validated at construction (`ValueError`).

    `pooling_type`: "last" (the last prompt token's hidden state: the default for decoder models, as vLLM's) or
    "mean" (the mean over every prompt token). `normalize`: divide by the L2 norm. `dimensions`: keep only the first
    `dimensions` values (before normalising), for models trained for it (Matryoshka); see `check_dimensions`.
    """

    pooling_type: PoolingType = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """`ValueError` naming the field unless every field has a valid value."""
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}; got {self.pooling_type!r}.")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}.")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive int, got {self.dimensions!r}.")

    @property
    def needs_all_tokens(self) -> bool:
        """True when every prompt token's hidden state counts (mean), so no prompt token may come from the prefix
        cache; "last" needs only the last one, which is always computed."""
        return self.pooling_type == "mean"

    def clone(self, **changes: Any) -> "PoolingParams":
        """A validated copy with some fields changed."""
        return msgspec.structs.replace(self, **changes)


def matryoshka_dimensions(hf_config: Any) -> list[int] | None:
    """The embedding sizes a model allows `dimensions` to cut to, from its config (as vLLM reads it): the list in
    `matryoshka_dimensions` if set, else any size when `is_matryoshka` is true; None: the model allows no cut."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return [int(d) for d in dims]
    if getattr(hf_config, "is_matryoshka", False):
        return []  # any size up to the hidden size
    return None


def check_dimensions(params: PoolingParams, hf_config: Any) -> None:
    """`ValueError` when `params.dimensions` is set but the model's config allows no such cut: a model not trained
    for Matryoshka embeddings (no `matryoshka_dimensions` / `is_matryoshka` in its config.json), a size not in its
    `matryoshka_dimensions`, or one above its hidden size."""
    d = params.dimensions
    if d is None:
        return
    allowed = matryoshka_dimensions(hf_config)
    if allowed is None:
        raise ValueError(f"dimensions={d} is not supported by this model: its config declares no Matryoshka "
                         "embeddings (`matryoshka_dimensions` or `is_matryoshka` in config.json).")
    if allowed and d not in allowed:
        raise ValueError(f"dimensions={d} is not one of the model's matryoshka_dimensions {allowed}.")
    hidden = int(hf_config.hidden_size)
    if d > hidden:
        raise ValueError(f"dimensions={d} exceeds the model's embedding size ({hidden}).")
