"""The attention backends by name, one row each: what `attention_backend=` accepts, where each backend's class
lives, its place in 'auto''s order, and which models it serves; and the KV-cache formats `kv_cache_dtype=` names.

The one place that lists backend names. It imports nothing heavy, so the config validates `attention_backend=` in
the application's process, which never imports torch; the selector (vx.gpu.attention.selector) imports a backend's
module only when that backend is asked for. What a backend can serve on a given device and shape (CUDA, a C
compiler, an sm80 GPU, a head size, a quantized cache) is asked of its class there, at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"
"""Not a backend: asks the selector for the best one available on the device."""


@dataclass(frozen=True)
class AttentionBackendEntry:
    """One attention backend: its name, its class, where 'auto' tries it, and which models it serves."""

    name: str
    """What `attention_backend=` says; the class's `get_name()`."""
    backend_class: str
    """Its `AttentionBackend` subclass as "module:Class", imported only when the backend is asked for."""
    auto_order_cuda: int | None = None
    """Its place among the backends 'auto' tries on CUDA, lowest first; None: 'auto' does not try it there."""
    auto_order_elsewhere: int | None = None
    """Its place among the backends 'auto' tries on any other device, lowest first; None: not tried there."""
    fallback: bool = False
    """What 'auto' takes when none it tries can serve, on every device (it runs anywhere, gathering if it must)."""
    mla: bool = False
    """Serves multi-head latent attention models (DeepSeek-V2) and only those: their cache holds latent rows, which
    only it reads; 'auto' picks it for them, and every other backend is refused for them."""


BACKENDS: tuple[AttentionBackendEntry, ...] = (
    AttentionBackendEntry("torch", "vx.gpu.attention.torch_backend:TorchAttentionBackend", fallback=True),
    # torch with a C decode kernel.
    AttentionBackendEntry("cpu", "vx.gpu.attention.cpu_backend:CpuAttentionBackend", auto_order_elsewhere=0),
    AttentionBackendEntry("triton", "vx.gpu.attention.triton_backend:TritonAttentionBackend", auto_order_cuda=1),
    AttentionBackendEntry("flash_attn", "vx.gpu.attention.flash_attn_backend:FlashAttnBackend", auto_order_cuda=0),
    AttentionBackendEntry("mla", "vx.gpu.attention.mla_backend:MLAAttentionBackend", mla=True),
)
"""Every attention backend, one row each."""

ATTENTION_BACKEND_NAMES: tuple[str, ...] = (AUTO, *(b.name for b in BACKENDS))
"""Every value `attention_backend=` accepts."""

KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8_e4m3", "int8")
"""Every value `kv_cache_dtype=` accepts ("auto": the model dtype; the formats are in vx.gpu.attention.kv_format)."""


def attention_backend(name: str) -> AttentionBackendEntry:
    """The row of backend `name`; `ValueError` naming every accepted value otherwise."""
    for backend in BACKENDS:
        if backend.name == name:
            return backend
    raise ValueError(f"Unknown attention_backend {name!r}; choose one of: {', '.join(ATTENTION_BACKEND_NAMES)}.")


def auto_order(device_type: str) -> tuple[str, ...]:
    """The backends 'auto' tries on `device_type` ("cuda", "cpu", ...), best first, before the fallback."""
    if device_type == "cuda":
        placed = [(b.auto_order_cuda, b.name) for b in BACKENDS if b.auto_order_cuda is not None]
    else:
        placed = [(b.auto_order_elsewhere, b.name) for b in BACKENDS if b.auto_order_elsewhere is not None]
    return tuple(name for _, name in sorted(placed))


def fallback_backend() -> str:
    """The backend 'auto' takes when none it tries can serve."""
    return next(b.name for b in BACKENDS if b.fallback)


def mla_backend() -> str:
    """The backend of multi-head latent attention models."""
    return next(b.name for b in BACKENDS if b.mla)
