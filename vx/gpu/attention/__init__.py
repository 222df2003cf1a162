"""Attention backends and the selector that picks one by name.

Importing this package imports neither triton nor flash_attn: those load when their backend first runs,
so a test process can still decide TRITON_INTERPRET, and a broken flash_attn install only disqualifies
its own backend.
"""

from __future__ import annotations

import torch

from vx.gpu.attention.backend import AttentionBackend, AttentionImpl, CommonAttentionMetadata
from vx.gpu.attention.cpu_backend import CpuAttentionBackend
from vx.gpu.attention.flash_attn_backend import FlashAttnBackend
from vx.gpu.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from vx.gpu.attention.triton_backend import TritonAttentionBackend

BACKEND_NAMES = ("auto", "torch", "cpu", "triton", "flash_attn")
_OPTIONAL: dict[str, type] = {"cpu": CpuAttentionBackend, "triton": TritonAttentionBackend,
                              "flash_attn": FlashAttnBackend}


def _device_type(device: str | torch.device) -> str:
    return torch.device(device).type


def backend_problem(name: str, device: str | torch.device, *, dtype: torch.dtype | None = None,
                    head_dim: int | None = None, block_size: int | None = None) -> str | None:
    """Why backend `name` cannot serve this device/shape (None = it can). 'torch' always can."""
    if name == "torch":
        return None
    cls = _OPTIONAL[name]
    return (cls.unavailable_reason(_device_type(device))  # type: ignore[attr-defined]
            or cls.unsupported_reason(dtype=dtype, head_dim=head_dim,  # type: ignore[attr-defined]
                                      block_size=block_size))


def get_attn_backend(name: str, device: str | torch.device, *, dtype: torch.dtype | None = None,
                     head_dim: int | None = None, block_size: int | None = None) -> type[AttentionBackend]:
    """The backend class for `name` on `device`; the keyword arguments, when given, are checked too.

    'torch' runs anywhere. 'auto' on CUDA takes flash_attn if it imports and fits (and, when block_size
    is known, only if it is a multiple of 256: below that flash_attn gathers the context every layer),
    else triton if available, else torch; on CPU it takes cpu (torch with a C decode kernel) when that kernel
    builds, else torch. Naming an unavailable backend raises a
    ValueError saying why; 'triton' on CPU needs TRITON_INTERPRET=1 (Triton's interpreter, for tests).
    """
    if name == "torch":
        return TorchAttentionBackend
    shape = dict(dtype=dtype, head_dim=head_dim, block_size=block_size)
    if name == "auto":
        if _device_type(device) != "cuda":
            if backend_problem("cpu", device, **shape) is None:
                return CpuAttentionBackend
            return TorchAttentionBackend
        fa_paged = block_size is None or FlashAttnBackend.is_paged(block_size)
        if fa_paged and backend_problem("flash_attn", device, **shape) is None:
            return FlashAttnBackend
        if backend_problem("triton", device, **shape) is None:
            return TritonAttentionBackend
        return TorchAttentionBackend
    if name not in _OPTIONAL:
        raise ValueError(f"Unknown attention_backend {name!r}; choose one of: {', '.join(BACKEND_NAMES)}.")
    reason = backend_problem(name, device, **shape)
    if reason is not None:
        raise ValueError(f"attention_backend={name!r} is unavailable: {reason}.")
    return _OPTIONAL[name]


__all__ = ["AttentionBackend", "AttentionImpl", "BACKEND_NAMES", "CommonAttentionMetadata", "CpuAttentionBackend",
           "FlashAttnBackend",
           "TorchAttentionBackend", "TorchAttentionMetadata", "TritonAttentionBackend", "backend_problem",
           "get_attn_backend"]
