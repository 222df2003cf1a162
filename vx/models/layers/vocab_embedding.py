"""Vocabulary-parallel token embedding and LM head.

Each rank holds a contiguous slice of the vocabulary (padded so every rank gets the same row count).
With TP=1 this is a plain embedding / projection. A quantization method that quantizes the table (GGUF files
do) owns its parameters, its row lookup and its matmul (of this rank's rows: vocab_start..vocab_end, padded);
otherwise the table is a float `weight`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from vx.distributed import GroupCoordinator
    from vx.models.layers.quantization.base_config import EmbeddingMethodBase, QuantizationConfig


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose vocabulary rows are split across TP ranks."""

    # Whether this table also computes the logits (an LM head, or an embedding a head is tied to): a quantization
    # method then readies a matmul for it as well as the row lookup.
    serves_lm_head: bool = False

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_size: int = 1, tp_rank: int = 0,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 tp_group: GroupCoordinator | None = None) -> None:
        super().__init__()
        if tp_group is not None:
            tp_size, tp_rank = tp_group.world_size, tp_group.rank_in_group
        self.tp_group = tp_group
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.num_embeddings_per_partition = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        self.quant_method: EmbeddingMethodBase | None = (
            quant_config.get_embedding_method(self, prefix) if quant_config is not None else None)
        if self.quant_method is not None:
            self.quant_method.create_weights(self, self.num_embeddings_per_partition, embedding_dim,
                                             torch.get_default_dtype())
        else:
            self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim),
                                       requires_grad=False)
            self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        """Copy this rank's vocabulary rows; padding rows (last rank only) are zeroed."""
        if loaded_weight.dim() != 2 or loaded_weight.shape[1] != self.embedding_dim \
                or loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(f"{type(self).__name__}: checkpoint shape {tuple(loaded_weight.shape)} does not "
                             f"match ({self.num_embeddings}, {self.embedding_dim}).")
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded_weight[self.vocab_start:self.vocab_end])
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embed token ids [T] -> [T, embedding_dim]."""
        if self.tp_size > 1:
            # Each rank embeds the ids of its slice (zeros for the others); the sum over the ranks is the embedding.
            mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
            rows = self._lookup(torch.where(mine, input_ids - self.vocab_start, 0))
            return self.tp_group.all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype))
        return self._lookup(input_ids)

    def _lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Rows of this rank's table (ids counted from its first row), through the quantization method if any."""
        if self.quant_method is not None:
            return self.quant_method.embedding(self, local_ids)
        return F.embedding(local_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_rank}/{self.tp_size}"


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary; may share its weight with the embedding (`tie_weights`)."""

    serves_lm_head = True

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, tp_size: int = 1,
                 tp_rank: int = 0, quant_config: QuantizationConfig | None = None, prefix: str = "",
                 tp_group: GroupCoordinator | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, tp_size, tp_rank, quant_config, prefix, tp_group)
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(torch.zeros(self.num_embeddings_per_partition),
                                                          requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's table (tie_word_embeddings): the same tensors and method, loaded and readied
        once (through the embedding)."""
        for name in list(self._parameters):
            if name != "bias":
                del self._parameters[name]
        for name, param in embedding.named_parameters(recurse=False):
            self.register_parameter(name, param)
        self.quant_method = embedding.quant_method
        self.__dict__["tied_embedding"] = embedding  # a plain reference: not a submodule of the head
        embedding.serves_lm_head = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Logits [N, vocab] in float32 for hidden states [N, hidden]."""
        if self.quant_method is not None:
            # A tied head computes from the embedding's state, which the method readied on that module.
            table = self.__dict__.get("tied_embedding", self)
            logits = self.quant_method.apply(table, hidden_states, self.bias)
        else:
            logits = F.linear(hidden_states, self.weight, self.bias)
        if self.tp_size > 1:
            # Each rank's vocabulary slice of the logits, gathered in rank order (the padding rows cut below).
            logits = self.tp_group.all_gather(logits, dim=-1)
        if logits.shape[-1] != self.num_embeddings:
            logits = logits[..., : self.num_embeddings]
        return logits.float()
