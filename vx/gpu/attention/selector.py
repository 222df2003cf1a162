"""Picking an attention backend by name: the registry's classes, imported only when asked for."""

from __future__ import annotations

import importlib

import torch

from vx.attention_backends import ATTENTION_BACKEND_NAMES, AUTO, BACKEND_CLASSES
from vx.gpu.attention.backend import AttentionBackend

# What 'auto' tries before torch (which runs anywhere), best first: on CUDA flash_attn, then triton; elsewhere
# the cpu backend (torch with a C decode kernel).
_AUTO_ORDER_CUDA = ("flash_attn", "triton")
_AUTO_ORDER_ELSEWHERE = ("cpu",)
MLA = "mla"  # the one backend of multi-head latent attention models


def load_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered as `name`, its module imported now (and kept by Python's import cache)."""
    try:
        module, _, cls = BACKEND_CLASSES[name].partition(":")
    except KeyError:
        raise ValueError(f"Unknown attention_backend {name!r}; choose one of: "
                         f"{', '.join(ATTENTION_BACKEND_NAMES)}.") from None
    return getattr(importlib.import_module(module), cls)


def backend_problem(name: str, device: str | torch.device, *, dtype: torch.dtype | None = None,
                    head_dim: int | None = None, block_size: int | None = None,
                    kv_cache_dtype: str | None = None, logits_soft_cap: bool = False) -> str | None:
    """Why backend `name` cannot serve this device/shape/KV-cache format, or a model whose attention scores are
    soft-capped (Gemma 2), (None = it can)."""
    cls = load_backend(name)
    reason = (cls.unavailable_reason(torch.device(device).type)
              or cls.unsupported_reason(dtype=dtype, head_dim=head_dim, block_size=block_size,
                                        kv_cache_dtype=kv_cache_dtype))
    if reason is None and logits_soft_cap and not cls.get_impl_cls().supports_logits_soft_cap:
        reason = "it does not apply attention-logit soft-capping (Gemma 2)"
    return reason


def get_attn_backend(name: str, device: str | torch.device, *, dtype: torch.dtype | None = None,
                     head_dim: int | None = None, block_size: int | None = None,
                     kv_cache_dtype: str | None = None, logits_soft_cap: bool = False,
                     mla: bool = False) -> type[AttentionBackend]:
    """The backend class for `name` on `device`; the keyword arguments, when given, are checked too.

    'torch' runs anywhere. 'auto' on CUDA takes flash_attn if it imports and fits (and, when block_size
    is known, only if it is a multiple of 256: below that flash_attn gathers the context every layer),
    else triton if available, else torch; on CPU it takes cpu (torch with a C decode kernel) when that kernel
    builds, else torch. A backend that cannot read the `kv_cache_dtype` (flash_attn: a quantized cache), or cannot
    soft-cap the scores when the model does (`logits_soft_cap`), is passed over. Naming an unavailable backend
    raises a ValueError saying why; 'triton' on CPU needs TRITON_INTERPRET=1
    (Triton's interpreter, for tests); when not even torch can serve the shape, 'auto' raises too.

    A multi-head latent attention model (`mla`, DeepSeek-V2) caches latent rows, which only the 'mla' backend reads:
    'auto' picks it, any other name is refused, and 'mla' is refused for every other model.
    """
    shape = dict(dtype=dtype, head_dim=head_dim, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                 logits_soft_cap=logits_soft_cap)
    if mla or name == MLA:
        if not mla:
            raise ValueError("attention_backend='mla' serves multi-head latent attention models (DeepSeek-V2) only.")
        if name not in (AUTO, MLA):
            raise ValueError(f"attention_backend={name!r} cannot serve a multi-head latent attention model "
                             "(DeepSeek-V2): its cache holds latent rows; use 'auto' or 'mla'.")
        reason = backend_problem(MLA, device, **shape)
        if reason is not None:
            raise ValueError(f"attention_backend={name!r} is unavailable: {reason}.")
        return load_backend(MLA)
    if name == AUTO:
        order = _AUTO_ORDER_CUDA if torch.device(device).type == "cuda" else _AUTO_ORDER_ELSEWHERE
        for candidate in order:
            cls = load_backend(candidate)
            # A backend that would gather the context every layer is not chosen unasked.
            paged = block_size is None or cls.is_paged(block_size)
            if paged and backend_problem(candidate, device, **shape) is None:
                return cls
        reason = backend_problem("torch", device, **shape)
        if reason is not None:
            raise ValueError(f"attention_backend='auto' found no backend: even torch cannot serve this ({reason}).")
        return load_backend("torch")
    reason = backend_problem(name, device, **shape)
    if reason is not None:
        raise ValueError(f"attention_backend={name!r} is unavailable: {reason}.")
    return load_backend(name)
