"""Engine configuration: flat user-facing `EngineArgs`, validated into a structured `VxConfig` that crosses whole to
the engine process. One module per concept; the names below are imported eagerly (all of it is torch-free).

- vx_config: `VxConfig` and its parts (msgspec Structs)
- engine_args: `EngineArgs` and its checks
- hf_config: the model's Hugging Face config, read and resolved
- wire: `encode_config` / `decode_config`
- cpu_defaults: engine defaults that scale with the CPU
- model_source: where a model comes from (default model, GGUF file, directory, Hugging Face id)
- model_limits, checkpoint_files: a model config checked against hostile values and against its weight files
"""

from vx.config.engine_args import EngineArgs, check_parallel_split
from vx.config.hf_config import (HFConfig, ResolvedHFConfig, checkpoint_quantization_config, hf_head_dim, hf_is_mla,
                                 hf_kv_cache_dims, hf_num_kv_heads, read_json, resolve_hf_config,
                                 resolve_quantization)
from vx.config.vx_config import (DEFAULT_MAX_N_SEQUENCES, SCHEDULING_POLICIES, CacheConfig, DeviceConfig,
                                 ModelConfig, ParallelConfig, QuantConfig, SchedulerConfig, StructuredOutputsConfig,
                                 VxConfig)
from vx.config.wire import decode_config, encode_config

__all__ = [
    "CacheConfig", "DEFAULT_MAX_N_SEQUENCES", "DeviceConfig", "EngineArgs", "HFConfig", "ModelConfig",
    "ParallelConfig", "QuantConfig", "ResolvedHFConfig", "SCHEDULING_POLICIES", "SchedulerConfig",
    "StructuredOutputsConfig", "VxConfig", "check_parallel_split", "checkpoint_quantization_config",
    "decode_config", "encode_config", "hf_head_dim", "hf_is_mla", "hf_kv_cache_dims", "hf_num_kv_heads", "read_json",
    "resolve_hf_config", "resolve_quantization",
]
