"""The C kernels a CPU worker's model may use, built together before the model loads.

Each kernel's loader builds its library on first use, one after the other as the model loads, which on a fresh
machine is seconds of -O3 compiles each. Built here first, they compile in parallel and with one progress line
(`vx.kernels.build.build_libraries`); the loads that follow find them in the cache. The choice is by the config
alone, before anything loads: a library that the model then does not call (the attention kernel under a backend
that `auto` turns down, the quantized matmuls of a method that multiplies through torch) costs one build, once a
machine.
"""

from __future__ import annotations

from vx import envs
from vx.config import VxConfig
from vx.gpu.attention import cpu_kernels
from vx.kernels import gguf_matmul, quant_matmul
from vx.kernels.build import Library, build_libraries

# Quantization methods whose CPU weights multiply through torch, not vx's kernels.
_TORCH_MATMUL_METHODS = frozenset({"fp8"})


def cpu_kernel_libraries(config: VxConfig) -> list[Library]:
    """The kernel libraries a CPU worker of `config` may load."""
    libraries = []
    if config.device_config.attention_backend in ("auto", "cpu") and not config.model_config.is_mla:
        libraries.append(cpu_kernels.LIBRARY)
    method = config.quant_config.method
    if method == "gguf":
        libraries += gguf_matmul.default_libraries()
    elif method is not None and method not in _TORCH_MATMUL_METHODS:
        libraries += quant_matmul.default_libraries()
    return libraries


def build_cpu_kernels(config: VxConfig) -> None:
    """Build the libraries of `cpu_kernel_libraries` the cache lacks, in parallel; nothing when all are cached or
    kernels are off (`VX_CPU_KERNELS=0`)."""
    if envs.VX_CPU_KERNELS.get():
        build_libraries(cpu_kernel_libraries(config))
