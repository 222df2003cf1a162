"""The C kernels a CPU worker's model may use, built together before the model loads.

Each kernel's loader builds its library on first use, one after the other as the model loads, which on a fresh
machine is seconds of -O3 compiles each. Built here first, they compile in parallel and with one progress line
(`vx.kernels.build.build_libraries`); the loads that follow find them in the cache. The choice is by the config
alone, before anything loads: a library that the model then does not call (the attention kernel under a backend
that `auto` turns down, the quantized matmuls of a method that multiplies through torch) costs one build, once a
machine.
"""

from __future__ import annotations

import importlib

from vx import envs
from vx.config import VxConfig
from vx.gpu.attention import cpu_kernels
from vx.kernels.build import Library, build_libraries
from vx.models.layers.quantization.registry import quantization_method


def cpu_kernel_libraries(config: VxConfig) -> list[Library]:
    """The kernel libraries a CPU worker of `config` may load."""
    libraries = []
    if config.device_config.attention_backend in ("auto", "cpu") and not config.model_config.is_mla:
        libraries.append(cpu_kernels.LIBRARY)
    method = config.quant_config.method
    kernels = quantization_method(method).cpu_kernels if method is not None else None
    if kernels is not None:
        libraries += importlib.import_module(f"vx.kernels.{kernels}").default_libraries()
    return libraries


def build_cpu_kernels(config: VxConfig) -> None:
    """Build the libraries of `cpu_kernel_libraries` the cache lacks, in parallel; nothing when all are cached or
    kernels are off (`VX_CPU_KERNELS=0`)."""
    if envs.VX_CPU_KERNELS.get():
        build_libraries(cpu_kernel_libraries(config))
