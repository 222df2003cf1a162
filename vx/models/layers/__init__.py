"""Building blocks of the model files: TP-shaped linear layers, norm, rotary, activation, embedding, attention."""

from vx.models.layers.activation import SiluAndMul
from vx.models.layers.attention import Attention
from vx.models.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                     ReplicatedLinear, RowParallelLinear)
from vx.models.layers.norm import RMSNorm
from vx.models.layers.rotary import RotaryEmbedding, get_rope
from vx.models.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

__all__ = [
    "Attention", "ColumnParallelLinear", "MergedColumnParallelLinear", "ParallelLMHead", "QKVParallelLinear",
    "RMSNorm", "ReplicatedLinear", "RotaryEmbedding", "RowParallelLinear", "SiluAndMul", "VocabParallelEmbedding",
    "get_rope",
]
