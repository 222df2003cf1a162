"""Classes named by a `"package.module:ClassName"` string, as engine arguments let a user plug in their own
(`distributed_executor_backend`, `worker_cls`): imported where they run."""

from __future__ import annotations

import importlib


def load_class(path: str, base: type, argument: str, base_name: str | None = None) -> type:
    """The subclass of `base` that `path` ("package.module:ClassName") names; `ValueError` naming `argument` (and
    `base_name`, default the class's name) when it is no such class. A module that does not import raises its
    `ImportError`."""
    module_name, _, class_name = path.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{argument}={path!r} names no {base_name or base.__name__} subclass.")
    return cls
