"""Names imported where they are used: classes named by a `"package.module:ClassName"` string (as engine arguments
let a user plug in their own: `distributed_executor_backend`, `worker_cls`; as registries name theirs), and a
package's lazy names."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def load_name(path: str) -> Any:
    """What `path` ("package.module:name") names, its module imported now; `AttributeError` when the module has no
    such name, `ImportError` when the module does not import."""
    module_name, _, name = path.partition(":")
    return getattr(importlib.import_module(module_name), name)


def load_class(path: str, base: type, argument: str, base_name: str | None = None) -> type:
    """The subclass of `base` that `path` ("package.module:ClassName") names; `ValueError` naming `argument` (and
    `base_name`, default the class's name) when it is no such class. A module that does not import raises its
    `ImportError`."""
    module_name, _, class_name = path.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{argument}={path!r} names no {base_name or base.__name__} subclass.")
    return cls


def lazy_names(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's module `__getattr__` that imports each name of `names` (name -> its module) when first asked
    for: importing the package then imports nothing, so a torch-free process can pass through it."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
