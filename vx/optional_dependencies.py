"""A missing optional dependency as an error that says what to install, for the features behind vx's extras.

`vx serve` and `vx.openai_client` need packages a plain `pip install vx` leaves out (pyproject.toml's
optional-dependencies). A bare `ModuleNotFoundError: No module named 'fastapi'` names a package deep in the import
chain, not the extra that brings all of them, so both places import under `needs_extra`, which says both.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency of a vx feature is not installed; the message names the pip extra that installs it.

    A `ModuleNotFoundError` (so an `ImportError`), so that code catching those keeps working."""


@contextmanager
def needs_extra(feature: str, extra: str) -> Iterator[None]:
    """Imports inside the block that find a third-party module missing raise `MissingExtraError` for `feature`.

    A missing module of vx itself is a broken install, not a missing extra: it propagates as it is."""
    try:
        yield
    except ModuleNotFoundError as e:
        if isinstance(e, MissingExtraError) or (e.name or "").split(".")[0] == "vx":
            raise
        raise MissingExtraError(f"{feature} needs the `{extra}` extra (missing: {e.name}): pip install 'vx[{extra}]'",
                                name=e.name) from e
