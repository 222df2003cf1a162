"""Hugging Face architecture name -> vx model class."""

from __future__ import annotations

from torch import nn

from vx.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from vx.models.llama import LlamaForCausalLM
from vx.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from vx.models.phi3 import Phi3ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def supported_architectures() -> list[str]:
    """Architecture names (as in config.json `architectures`) that vx can run."""
    return sorted(_MODELS)


def resolve_model_class(arch: str) -> type[nn.Module]:
    """The class serving `arch`; ValueError listing the supported ones if there is none."""
    try:
        return _MODELS[arch]
    except KeyError:
        raise ValueError(f"Model architecture {arch!r} is not supported. "
                         f"Supported: {', '.join(supported_architectures())}.") from None
