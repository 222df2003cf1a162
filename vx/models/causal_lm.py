"""What every decoder-only family shares: the LM head (tied or not) and loading Hugging Face named tensors."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable

import torch
from torch import nn

from vx.models.layers.quantization import QuantizationConfig
from vx.models.layers.vocab_embedding import ParallelLMHead

if TYPE_CHECKING:
    from vx.distributed import GroupCoordinator

logger = logging.getLogger(__name__)


def _packed_modules(stacked_params: list[tuple[str, str, str | int]]) -> dict[str, tuple[str, ...]]:
    """Fused layer name -> the checkpoint modules it fuses, in shard order."""
    mapping: dict[str, tuple[str, ...]] = {}
    for fused, ckpt, _ in stacked_params:
        mapping[fused] = mapping.get(fused, ()) + (ckpt,)
    return mapping


class CausalLM(nn.Module):
    """A decoder (`model`: token ids and positions -> final-normed hidden states) with its LM head, and the loading
    of Hugging Face checkpoints into fused parameters; each family builds its own decoder."""

    # (fused name, checkpoint name, shard id) for the weight loader.
    _stacked_params: list[tuple[str, str, str | int]] = [
        ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    ]
    # For quantization configs whose module lists name checkpoint modules (QuantizationConfig.packed_modules_mapping).
    packed_modules_mapping = _packed_modules(_stacked_params)
    # Checkpoint entries that are derived state, not weights.
    _skip_suffixes = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

    def __init__(self, hf_config: Any, model: nn.Module, quant_config: QuantizationConfig | None = None,
                 tp_group: GroupCoordinator | None = None) -> None:
        super().__init__()
        self.config = hf_config
        self.model = model
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        # A pipeline stage (vx/models/llama.py) holds the LM head on the last stage only; a tied head there, away
        # from the first stage's embedding, loads its own copy of the embedding's table.
        self.is_last_stage = getattr(model, "is_last_stage", True)
        first_stage = getattr(model, "is_first_stage", True)
        self.head_loads_embedding = self.tie_word_embeddings and self.is_last_stage and not first_stage
        self.missing_prefixes: tuple[str, ...] = tuple(getattr(model, "missing_prefixes", ()))
        if self.is_last_stage:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size,
                                          quant_config=None if self.tie_word_embeddings else quant_config,
                                          prefix="lm_head", tp_group=tp_group)
            if self.tie_word_embeddings and first_stage:
                self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = nn.Identity()  # another stage's
            self.missing_prefixes += ("lm_head.",)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any,
                intermediate: torch.Tensor | None = None) -> torch.Tensor:
        """Flattened batch tokens [T] at `positions` [T] -> hidden states [T, hidden]; a pipeline stage's model
        takes and returns the stages' `intermediate` tensors instead (vx/models/llama.py)."""
        if intermediate is None:
            return self.model(input_ids, positions, attn_metadata)
        return self.model(input_ids, positions, attn_metadata, intermediate)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the rows that sample."""
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face named tensors into (fused) parameters; returns the parameter names loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        shards_seen: dict[str, set[str | int]] = {}
        for name, tensor in weights:
            if name.endswith(self._skip_suffixes):
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # the embedding holds this tensor
            if self.head_loads_embedding and name == "model.embed_tokens.weight":
                name = "lm_head.weight"  # this stage's head, tied to an embedding on the first stage
            elif name.startswith(self.missing_prefixes):
                continue  # another pipeline stage's
            target, shard_id = name, None
            for fused, ckpt, sid in self._stacked_params:
                if f".{ckpt}." in name:
                    target, shard_id = name.replace(f".{ckpt}.", f".{fused}."), sid
                    break
            param = params.get(target)
            if param is None:
                logger.warning("Ignoring checkpoint tensor %s: the model has no parameter for it.", name)
                continue
            loader = getattr(param, "weight_loader", default_weight_loader)
            with torch.no_grad():
                if shard_id is None:
                    loader(param, tensor)
                    loaded.add(target)
                else:
                    loader(param, tensor, shard_id)
                    shards_seen.setdefault(target, set()).add(shard_id)
        # A fused parameter counts as loaded only once every sub-projection has arrived.
        for target, seen in shards_seen.items():
            expected = {sid for fused, _, sid in self._stacked_params if f".{fused}." in target}
            if seen >= expected:
                loaded.add(target)
        return loaded


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Whole-tensor copy with a shape check, for parameters without a sharding rule (norms)."""
    if param.shape != loaded_weight.shape:
        raise ValueError(f"checkpoint shape {tuple(loaded_weight.shape)} does not match {tuple(param.shape)}.")
    param.data.copy_(loaded_weight)
