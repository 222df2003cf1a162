"""Vocabulary-parallel token embedding and LM head.

Each rank holds a contiguous slice of the vocabulary (padded so every rank gets the same row count).
With TP=1 this is a plain embedding / projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose vocabulary rows are split across TP ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.num_embeddings_per_partition = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
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
            # Would need masking of out-of-shard ids plus an all-reduce; not wired yet.
            raise NotImplementedError("VocabParallelEmbedding with tp_size > 1 is not wired yet.")
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_rank}/{self.tp_size}"


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary; may share its weight with the embedding (`tie_weights`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, tp_size: int = 1,
                 tp_rank: int = 0) -> None:
        super().__init__(num_embeddings, embedding_dim, tp_size, tp_rank)
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(torch.zeros(self.num_embeddings_per_partition),
                                                          requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (tie_word_embeddings): one tensor, loaded once."""
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Logits [N, vocab] in float32 for hidden states [N, hidden]."""
        if self.tp_size > 1:
            raise NotImplementedError("ParallelLMHead with tp_size > 1 needs a gather (not wired yet).")
        logits = F.linear(hidden_states, self.weight, self.bias)
        if logits.shape[-1] != self.num_embeddings:
            logits = logits[..., : self.num_embeddings]
        return logits.float()
