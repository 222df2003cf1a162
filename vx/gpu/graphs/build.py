"""The one entry point a model runner uses: whether its model gets decode graphs, which capture makes them, and
which sizes are built before serving.

The capture follows the device and `VX_DECODE_GRAPHS`: CUDA graphs on CUDA; on the CPU AOT-compiled packages loaded
without the compiler (`aoti`, the default, falling back to in-process compiles) or inductor in the engine
(`inductor`). `VX_DECODE_COMPILE` says when: `background` (size 1 now, the rest when first needed), `startup` (all
before serving) or `off`; a CUDA capture is always made at start-up, since it must not overlap eager steps.
"""

from __future__ import annotations

import torch

from vx import envs
from vx.kv_spec import KVCacheGroupSpec
from vx.config import VxConfig
from vx.gpu.attention.backend import AttentionBackend
from vx.gpu.graphs.aoti_loader import AotiGraphs
from vx.gpu.graphs.buffers import capture_sizes
from vx.gpu.graphs.capture import GraphCapture, decode_forward, own_copy
from vx.gpu.graphs.cuda import CudaGraphs
from vx.gpu.graphs.decode_graphs import DecodeGraphs
from vx.gpu.graphs.inductor import InductorGraphs

def build_decode_graphs(model: torch.nn.Module, config: VxConfig, device: torch.device,
                        attn_backend: type[AttentionBackend], num_kv_blocks: int,
                        kv_cache_groups: tuple[KVCacheGroupSpec, ...], several_ranks: bool) -> DecodeGraphs | None:
    """The decode graphs of a runner whose KV caches are bound (compiled on the CPU, CUDA graphs on CUDA), their
    first sizes built or queued; None when `enforce_eager`, `VX_DECODE_COMPILE=off`, a rank of several, or a model
    or attention backend that cannot run inside one."""
    when = envs.VX_DECODE_COMPILE.get()
    # A rank of several runs eagerly: its collectives and stage transfers are not captured in a graph yet.
    if (config.device_config.enforce_eager or when == "off" or several_ranks
            or not getattr(model, "supports_decode_graphs", True)
            or not attn_backend.supports_decode_graphs(device.type)):
        return None
    max_blocks = -(-config.model_config.max_model_len // config.cache_config.block_size)
    max_num_seqs = config.scheduler_config.max_num_seqs
    graphs = DecodeGraphs(model, max_num_seqs, max_blocks, device,
                          capture=_capture(model, config, device, num_kv_blocks, kv_cache_groups, max_blocks),
                          num_kv_cache_groups=max(1, len(kv_cache_groups)))
    # A CUDA capture takes milliseconds and must not overlap eager steps: always before serving.
    if when == "startup" or device.type == "cuda":
        graphs.compile_now()
    else:
        graphs.compile_in_background(1)
    return graphs


def _capture(model: torch.nn.Module, config: VxConfig, device: torch.device, num_kv_blocks: int,
             kv_cache_groups: tuple[KVCacheGroupSpec, ...], max_blocks: int) -> GraphCapture:
    """How this runner's graphs are made: by device, then `VX_DECODE_GRAPHS` on the CPU."""
    # A code object of its own per engine: dynamo must never serve one engine's call with another's graph.
    forward = own_copy(decode_forward, f"decode_forward_{id(model):x}")
    if device.type == "cuda":
        return CudaGraphs(forward)
    num_sizes = len(capture_sizes(config.scheduler_config.max_num_seqs, device.type))
    if device.type == "cpu" and envs.VX_DECODE_GRAPHS.get() == "aoti":
        # The fallback is made only when needed: making it imports the compiler.
        return AotiGraphs(model, config, num_kv_blocks, kv_cache_groups, max_blocks,
                          lambda: InductorGraphs(forward, num_sizes))
    return InductorGraphs(forward, num_sizes)
