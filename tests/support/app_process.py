"""What the application process may load of the model side: the registries it reads to check a config (torch-free
modules beside their code) and the lazy package `__init__` files on their way; nothing else of vx.gpu or vx.models,
and no torch."""

from __future__ import annotations

REGISTRY_MODULES = (
    "vx.gpu", "vx.gpu.attention", "vx.gpu.attention.registry",
    "vx.models", "vx.models.registry", "vx.models.gguf", "vx.models.gguf.header",
    "vx.models.layers", "vx.models.layers.quantization", "vx.models.layers.quantization.registry",
    "vx.models.layers.quantization.tp_split",
)

MODEL_SIDE_CHECK = (
    f"allowed = {REGISTRY_MODULES!r}\n"
    "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch'\n"
    "             or (m.startswith(('vx.gpu', 'vx.models')) and m not in allowed))\n"
)
"""Python source (after `import sys`) that sets `bad` to the modules the application process must not have loaded."""
