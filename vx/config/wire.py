"""The config as it crosses to the engine process: `VxConfig` whole, as msgpack.

The front end resolves the config once; the engine process (and its workers) use it as it arrives, so every field
crosses and none is resolved again, except the Hugging Face config's defaults where a light front end left them out.
"""

from __future__ import annotations

import msgspec

from vx.config.hf_config import HFConfig, ResolvedHFConfig, config_fields, resolve_hf_config
from vx.config.vx_config import VxConfig


def encode_config(config: VxConfig) -> bytes:
    """`config` whole, as msgpack: what the engine process receives. The HF config goes as [fields, resolved]: a
    transformers config's `to_dict()` is resolved already, config.json as a light front end read it is not."""
    mc = config.model_config
    if mc.hf_config is not None:  # its own form: msgspec would take a transformers config apart
        resolved = not isinstance(mc.hf_config, HFConfig) or isinstance(mc.hf_config, ResolvedHFConfig)
        config = msgspec.structs.replace(config, model_config=msgspec.structs.replace(
            mc, hf_config=[config_fields(mc.hf_config), resolved]))
    return msgspec.msgpack.encode(config)


def decode_config(data: bytes) -> VxConfig:
    """The `VxConfig` of `encode_config`, every field as it was sent; the HF config becomes an `HFConfig` of every
    field transformers resolves (without importing transformers, once the fields' resolution is cached)."""
    config = msgspec.msgpack.decode(data, type=VxConfig)
    mc = config.model_config
    if mc.hf_config is not None:
        fields, resolved = mc.hf_config
        mc.hf_config = ResolvedHFConfig(fields) if resolved else resolve_hf_config(fields, mc.model)
    return config
