"""Picking an attention backend by name: the registry's classes, imported only when asked for, and 'auto''s choice
in the order the registry's rows give."""

from __future__ import annotations

import torch

from vx.class_path import load_name
from vx.gpu.attention.backend import AttentionBackend
from vx.gpu.attention.registry import AUTO, attention_backend, auto_order, fallback_backend, mla_backend


def load_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered as `name`, its module imported now (and kept by Python's import cache)."""
    return load_name(attention_backend(name).backend_class)


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

    'torch' runs anywhere. 'auto' tries the backends in the registry's order for the device and takes the first
    that is available, fits, and (when block_size is known) is paged at that block size rather than gathering the
    context every layer, else the fallback (torch): on CUDA flash_attn (paged from blocks of 256), then triton; on
    CPU cpu (torch with a C decode kernel) when that kernel builds. A backend that cannot read the `kv_cache_dtype`
    (flash_attn: a quantized cache), or cannot soft-cap the scores when the model does (`logits_soft_cap`), is
    passed over. Naming an unavailable backend
    raises a ValueError saying why; 'triton' on CPU needs TRITON_INTERPRET=1
    (Triton's interpreter, for tests); when not even torch can serve the shape, 'auto' raises too.

    A multi-head latent attention model (`mla`, DeepSeek-V2) caches latent rows, which only the 'mla' backend reads:
    'auto' picks it, any other name is refused, and 'mla' is refused for every other model.
    """
    shape = dict(dtype=dtype, head_dim=head_dim, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                 logits_soft_cap=logits_soft_cap)
    mla_name = mla_backend()
    if mla or name == mla_name:
        if not mla:
            raise ValueError(f"attention_backend={name!r} serves multi-head latent attention models (DeepSeek-V2) "
                             "only.")
        if name not in (AUTO, mla_name):
            raise ValueError(f"attention_backend={name!r} cannot serve a multi-head latent attention model "
                             f"(DeepSeek-V2): its cache holds latent rows; use {AUTO!r} or {mla_name!r}.")
        reason = backend_problem(mla_name, device, **shape)
        if reason is not None:
            raise ValueError(f"attention_backend={name!r} is unavailable: {reason}.")
        return load_backend(mla_name)
    if name == AUTO:
        for candidate in auto_order(torch.device(device).type):
            cls = load_backend(candidate)
            # A backend that would gather the context every layer is not chosen unasked.
            paged = block_size is None or cls.is_paged(block_size)
            if paged and backend_problem(candidate, device, **shape) is None:
                return cls
        fallback = fallback_backend()
        reason = backend_problem(fallback, device, **shape)
        if reason is not None:
            raise ValueError(f"attention_backend={AUTO!r} found no backend: even {fallback} cannot serve this "
                             f"({reason}).")
        return load_backend(fallback)
    reason = backend_problem(name, device, **shape)
    if reason is not None:
        raise ValueError(f"attention_backend={name!r} is unavailable: {reason}.")
    return load_backend(name)
