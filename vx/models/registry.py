"""The model architectures vx runs: one row each, with everything vx knows of it (the Hugging Face name, the class
that serves it, whether it splits over workers, its structural quirks, its GGUF name and how llama.cpp's files of it
differ from the checkpoint).

This is the one place architecture names are written. The module imports nothing heavy: the config reads it in the
application's process to refuse an unknown architecture before an engine starts, and a family's module is imported
only when a model of it is built (`resolve_model_class`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vx.class_path import load_class

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class GGUFArchitecture:
    """How vx reads a GGUF file of one architecture (`general.architecture`) and where llama.cpp's converter wrote
    it differently from the checkpoint."""

    name: str
    """The file's `general.architecture`."""
    metadata_fields: tuple[tuple[str, str], ...] = ()
    """(config field, metadata key under `<name>.`) pairs transformers' mapping leaves out; read when present."""
    dropped_fields: tuple[str, ...] = ()
    """Config fields transformers sets for a fixed shape, dropped so the config class re-derives them for the file's."""
    wide_query_scale_layers: int | None = None
    """Set: the file states no query scale and llama.cpp scales by the head size, except for the model of this many
    layers, which it scales by hidden / heads (Gemma's 27B, as its checkpoint's query_pre_attn_scalar says)."""
    config_fields: str | None = None
    """"module:function" `(config, file) -> config` for what is code rather than data (read from tensors, or a
    different config class); None: none."""
    config_tensors: tuple[str, ...] = ()
    """Tensors (GGUF base names) the config is read from, not weights: skipped as the weights load."""
    whole_config: str | None = None
    """"module:function" `(path) -> config` for an architecture transformers maps no config (nor tokenizer) of: the
    whole config is read from the metadata and the tokenizer by the architecture-free fast tokenizer."""
    permuted_qk: bool = False
    """llama.cpp permuted the q and k rows for its rotary layout (its LlamaModel); they are put back as they load."""
    norms_plus_one: bool = False
    """The norm weights are stored as 1 + the checkpoint's (Gemma keeps offsets from 1); the offset comes off."""
    fused_projections: bool = False
    """q|k|v and gate|up are one tensor each, as the checkpoint keeps them; cut into their projections by rows."""
    extra_modules: tuple[str, ...] = ()
    """Per-layer Hugging Face modules beyond the Llama family's that the file's tensors map to."""
    float_modules: tuple[str, ...] = ()
    """Module name endings whose weights the model runs in float: dequantized as they load."""


@dataclass(frozen=True)
class ModelArchitecture:
    """One architecture vx runs: what config.json's `architectures` names, and all vx keys on it."""

    name: str
    """Hugging Face architecture name (config.json `architectures[0]`)."""
    model_class: str
    """"module:Class" of vx's model serving it, imported when first built."""
    model_type: str
    """The Hugging Face config's `model_type`, by which a family's layers find this row."""
    parallel: bool = False
    """Its model builds one tensor-parallel rank's shard and one pipeline stage's layers: `tensor_parallel_size` and
    `pipeline_parallel_size` above 1 accept it."""
    qkv_bias: bool | None = None
    """The q, k and v projections' bias whatever the config says (Qwen2's config states none); None: the config's
    `attention_bias`."""
    o_bias: bool | None = None
    """The output projection's bias likewise; None: the config's `attention_bias`."""
    qk_norm: bool = False
    """Queries and keys are RMS-normed per head before the rotary."""
    gguf: GGUFArchitecture | None = None
    """How its GGUF files read (None: vx loads none of them as this architecture)."""


# DeepSeek-V2's own modules: MLA's projections and norms (k_b_proj / v_b_proj: newer converters' split of kv_b_proj)
# and the shared experts.
_DEEPSEEK2_MODULES = ("self_attn.q_a_proj", "self_attn.q_a_layernorm", "self_attn.q_b_proj",
                      "self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm", "self_attn.kv_b_proj",
                      "self_attn.k_b_proj", "self_attn.v_b_proj", "mlp.shared_experts.gate_proj",
                      "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj")
# Read per head by the MLA backend (kv_b_proj, in either form) or kept float32 as Hugging Face does (the router).
_DEEPSEEK2_FLOAT_MODULES = (".self_attn.kv_b_proj", ".self_attn.k_b_proj", ".self_attn.v_b_proj",
                            ".mlp.gate")

_GGUF_CONFIG = "vx.models.gguf.config"

# In the order their GGUF names are listed to a user.
ARCHITECTURES: tuple[ModelArchitecture, ...] = (
    ModelArchitecture(
        "LlamaForCausalLM", "vx.models.llama:LlamaForCausalLM", "llama", parallel=True,
        # llama.cpp writes Mistral and Mixtral models as "llama" too (Mixtral with an expert count).
        gguf=GGUFArchitecture("llama", config_fields=f"{_GGUF_CONFIG}:experts_as_mixtral", permuted_qk=True)),
    ModelArchitecture(
        "Qwen2ForCausalLM", "vx.models.llama:LlamaForCausalLM", "qwen2", parallel=True, qkv_bias=True, o_bias=False,
        gguf=GGUFArchitecture("qwen2")),
    ModelArchitecture(
        "Qwen3ForCausalLM", "vx.models.llama:LlamaForCausalLM", "qwen3", parallel=True, qk_norm=True,
        gguf=GGUFArchitecture("qwen3")),
    ModelArchitecture(
        "Qwen3MoeForCausalLM", "vx.models.moe:Qwen3MoeForCausalLM", "qwen3_moe", parallel=True, qk_norm=True,
        gguf=GGUFArchitecture("qwen3moe", config_fields=f"{_GGUF_CONFIG}:qwen3moe_experts")),
    ModelArchitecture(
        "Gemma2ForCausalLM", "vx.models.gemma:Gemma2ForCausalLM", "gemma2",
        gguf=GGUFArchitecture(
            "gemma2", wide_query_scale_layers=46, norms_plus_one=True, dropped_fields=("layer_types",),
            metadata_fields=(("attn_logit_softcapping", "attn_logit_softcapping"),
                             ("final_logit_softcapping", "final_logit_softcapping")))),
    ModelArchitecture(
        "Gemma3ForCausalLM", "vx.models.gemma:Gemma3ForCausalLM", "gemma3_text", qk_norm=True,
        gguf=GGUFArchitecture("gemma3", wide_query_scale_layers=62, norms_plus_one=True)),
    ModelArchitecture(
        "Phi3ForCausalLM", "vx.models.phi3:Phi3ForCausalLM", "phi3",
        gguf=GGUFArchitecture("phi3", config_fields=f"{_GGUF_CONFIG}:phi3_rope", fused_projections=True,
                              config_tensors=("rope_factors_long", "rope_factors_short"))),
    ModelArchitecture(
        "DeepseekV2ForCausalLM", "vx.models.deepseek_v2:DeepseekV2ForCausalLM", "deepseek_v2",
        gguf=GGUFArchitecture("deepseek2", whole_config="vx.models.gguf.deepseek2:deepseek2_config",
                              extra_modules=_DEEPSEEK2_MODULES, float_modules=_DEEPSEEK2_FLOAT_MODULES)),
    ModelArchitecture("MistralForCausalLM", "vx.models.llama:LlamaForCausalLM", "mistral", parallel=True),
    ModelArchitecture("MixtralForCausalLM", "vx.models.moe:MixtralForCausalLM", "mixtral", parallel=True),
)


def supported_architectures() -> list[str]:
    """Architecture names (as in config.json `architectures`) that vx can run."""
    return sorted(a.name for a in ARCHITECTURES)


def unsupported_architecture(name: str) -> str | None:
    """Why `name` cannot run (None = it can): the message names the supported architectures."""
    if any(a.name == name for a in ARCHITECTURES):
        return None
    return f"Model architecture {name!r} is not supported. Supported: {', '.join(supported_architectures())}."


def model_architecture(name: str) -> ModelArchitecture:
    """The row of the Hugging Face architecture `name`; ValueError listing the supported ones if there is none."""
    row = next((a for a in ARCHITECTURES if a.name == name), None)
    if row is None:
        raise ValueError(unsupported_architecture(name))
    return row


def parallel_architectures() -> list[str]:
    """The architectures whose models split over tensor-parallel ranks and pipeline stages."""
    return sorted(a.name for a in ARCHITECTURES if a.parallel)


def architecture_of(hf_config: Any) -> ModelArchitecture | None:
    """The row of a Hugging Face config's `model_type` (None for a type vx has no row for): how a family's shared
    layers learn the quirks of the architecture they are built for."""
    model_type = getattr(hf_config, "model_type", None)
    return next((a for a in ARCHITECTURES if a.model_type == model_type), None)


def gguf_architecture(name: str) -> GGUFArchitecture:
    """How a GGUF file of `general.architecture` `name` reads; ValueError naming it and the supported ones unless vx
    loads its files."""
    row = next((a.gguf for a in ARCHITECTURES if a.gguf is not None and a.gguf.name == name), None)
    if row is None:
        supported = ", ".join(a.gguf.name for a in ARCHITECTURES if a.gguf is not None)
        raise ValueError(f"GGUF architecture {name!r} is not supported; supported: {supported}.")
    return row


def resolve_model_class(name: str) -> type[nn.Module]:
    """The class serving the Hugging Face architecture `name`; ValueError listing the supported ones if there is
    none."""
    from torch import nn

    row = model_architecture(name)
    return load_class(row.model_class, nn.Module, "model_class")
