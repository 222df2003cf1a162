"""The model architectures vx runs, by Hugging Face name, and where each one's class lives.

This is the one list of architectures. It imports nothing, so the config refuses an unknown architecture (naming
the supported ones) in the application's process, before an engine starts; `vx.models.registry` imports a family's
module only when a model of it is built.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

MODEL_CLASSES: Mapping[str, str] = MappingProxyType({
    "DeepseekV2ForCausalLM": "vx.models.deepseek_v2:DeepseekV2ForCausalLM",
    "Gemma2ForCausalLM": "vx.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "vx.models.gemma:Gemma3ForCausalLM",
    "LlamaForCausalLM": "vx.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "vx.models.llama:LlamaForCausalLM",
    "MixtralForCausalLM": "vx.models.moe:MixtralForCausalLM",
    "Phi3ForCausalLM": "vx.models.phi3:Phi3ForCausalLM",
    "Qwen2ForCausalLM": "vx.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "vx.models.llama:LlamaForCausalLM",
    "Qwen3MoeForCausalLM": "vx.models.moe:Qwen3MoeForCausalLM",
})
"""Hugging Face architecture name (config.json `architectures`) -> "module:class" of vx's model."""


PARALLEL_ARCHITECTURES: frozenset[str] = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "MixtralForCausalLM", "Qwen3MoeForCausalLM"})
"""The architectures whose model builds one rank's shard and one pipeline stage's layers (vx/models/llama.py's
decoder, with dense or mixture-of-experts MLPs): the ones `tensor_parallel_size` / `pipeline_parallel_size` above 1
accept."""


def unsupported_architecture(arch: str) -> str | None:
    """Why `arch` cannot run (None = it can): the message names the supported architectures."""
    if arch in MODEL_CLASSES:
        return None
    return f"Model architecture {arch!r} is not supported. Supported: {', '.join(sorted(MODEL_CLASSES))}."
