"""Model code: the loader, the architecture registry and the Llama-family model (no vx.gpu imports)."""

from vx.models.loader import DefaultModelLoader
from vx.models.registry import resolve_model_class, supported_architectures

__all__ = ["DefaultModelLoader", "resolve_model_class", "supported_architectures"]
