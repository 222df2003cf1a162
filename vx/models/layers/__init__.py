"""Building blocks of the model files: TP-shaped linear layers, norm, rotary, activation, embedding, attention.

The package itself imports nothing heavy: the application process reads `quantization.registry` without torch; the
layers load when first asked for.
"""

from __future__ import annotations

from vx.class_path import lazy_names

_LAZY = {
    "Attention": "vx.models.layers.attention",
    "ColumnParallelLinear": "vx.models.layers.linear",
    "MergedColumnParallelLinear": "vx.models.layers.linear",
    "ParallelLMHead": "vx.models.layers.vocab_embedding",
    "QKVParallelLinear": "vx.models.layers.linear",
    "RMSNorm": "vx.models.layers.norm",
    "ReplicatedLinear": "vx.models.layers.linear",
    "RotaryEmbedding": "vx.models.layers.rotary",
    "RowParallelLinear": "vx.models.layers.linear",
    "SiluAndMul": "vx.models.layers.activation",
    "VocabParallelEmbedding": "vx.models.layers.vocab_embedding",
    "get_rope": "vx.models.layers.rotary",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_names(__name__, _LAZY)
