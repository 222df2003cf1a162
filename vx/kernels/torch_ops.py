"""vx's C kernels as torch operators (`torch.ops.vx.*`), so that a compiled graph can call them.

The C kernels are called through ctypes with raw data pointers: a tracer (torch.compile, make_fx) cannot look
inside, so each is registered as an opaque operator with a shape-only ("Meta") implementation for tracing.
Registered with `torch.library.Library` rather than `torch.library.custom_op`: the latter's Python wrapper
measured ~100 us a call here against ~6-10 us for a plain registration, and a decode step makes ~150 such calls.
Eager code calls the kernels directly (no dispatcher at all); only traced code goes through these operators
(`tracing(x)` tells which).

This module registers the quantized matmuls (repacked, and GGUF blocks as stored); the attention backend
registers its decode operator (`vx.gpu.attention.cpu_kernels`) in the same `vx` namespace through `library()`.
"""

from __future__ import annotations

import functools

import torch

from vx.kernels.gguf_matmul import load_gguf_matmul_kernel
from vx.kernels.quant_matmul import PackedQuantWeight, load_quant_matmul_kernel

_SCHEMAS = (
    "quant_matmul(Tensor x, Tensor q, Tensor sz, int out_features, int group_size, int bits, bool int8_activations,"
    " bool amx) -> Tensor",
    "gguf_matmul(Tensor x, Tensor blocks, int ggml_type, bool amx) -> Tensor",
)


def tracing(x: torch.Tensor) -> bool:
    """Whether `x` belongs to a graph being traced (a fake or functional tensor, or a dynamo trace)."""
    return type(x) is not torch.Tensor or torch.compiler.is_compiling()


def _quant_matmul(x: torch.Tensor, q: torch.Tensor, sz: torch.Tensor, out_features: int, group_size: int,
                  bits: int, int8_activations: bool, amx: bool) -> torch.Tensor:
    kernel = load_quant_matmul_kernel()
    if kernel is None:
        raise RuntimeError("vx::quant_matmul: the CPU quantized matmul kernel is not available.")
    return kernel.matmul(x, PackedQuantWeight(q, sz, out_features, x.shape[1], group_size, bits, int8_activations,
                                                   amx))


def _gguf_matmul(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, amx: bool) -> torch.Tensor:
    kernel = load_gguf_matmul_kernel()
    if kernel is None:
        raise RuntimeError("vx::gguf_matmul: the CPU GGUF matmul kernel is not available.")
    return kernel.product(x, blocks, ggml_type, amx)


@functools.cache
def library() -> torch.library.Library:
    """The `vx` operator namespace of this process, with the quantized matmul defined (once per process)."""
    lib = torch.library.Library("vx", "FRAGMENT")
    for schema in _SCHEMAS:
        lib.define(schema)
    lib.impl("quant_matmul", _quant_matmul, "CPU")
    lib.impl("quant_matmul", lambda x, q, sz, out_features, group_size, bits, int8_activations, amx:
             x.new_empty(x.shape[0], out_features), "Meta")
    lib.impl("gguf_matmul", _gguf_matmul, "CPU")
    lib.impl("gguf_matmul", lambda x, blocks, ggml_type, amx: x.new_empty(x.shape[0], blocks.shape[0]), "Meta")
    return lib
