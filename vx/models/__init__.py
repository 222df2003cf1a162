"""Model code: the loader, the architecture registry and one file per model family (no vx.gpu imports).

The package itself imports nothing heavy: the application process reads `vx.models.registry` (which
architectures exist) without torch; the loader and the model classes load when first asked for.
"""

from __future__ import annotations

from vx.class_path import lazy_names

_LAZY = {
    "DefaultModelLoader": "vx.models.loader",
    "resolve_model_class": "vx.models.registry",
    "supported_architectures": "vx.models.registry",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_names(__name__, _LAZY)
