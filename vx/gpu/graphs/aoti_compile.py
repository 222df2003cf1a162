"""The child process that AOT-compiles one CPU decode graph (`vx.gpu.graphs.aoti_cache` runs it; the engine never
imports it).

    python -m vx.gpu.graphs.aoti_compile REQUEST.json

It rebuilds the engine's model runner from the engine's own config (the same model file, dtype, quantization, KV
cache blocks and groups: the graph bakes their shapes in), exports the decode forward at one padded batch size
and compiles it with AOTInductor into a package without its weights: the engine hands it its own tensors (weights
and KV caches) when it loads it. The compiler (torch._dynamo, torch._inductor, and their memory) thus lives
and dies here, never in the engine. Writes PACKAGE and its sidecar (`aoti_cache.sidecar_path`) atomically,
the sidecar last; exits non-zero on any failure.
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()  # before torch is imported: a sidecar records the child's whole time

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402


class DecodeStep(torch.nn.Module):
    """The decode graphs' forward with tensor inputs only: ids, positions, seq lens, then per KV-cache group its slot
    mapping and block table (the attention metadata is built inside the graph)."""

    def __init__(self, model: torch.nn.Module, num_groups: int) -> None:
        super().__init__()
        self.model = model
        self.num_groups = num_groups

    def forward(self, input_ids, positions, seq_lens, *per_group):
        from vx.gpu.attention.backend import DecodeGraphMetadata

        metadata = [DecodeGraphMetadata(slot_mapping=per_group[2 * g], block_table=per_group[2 * g + 1],
                                        seq_lens=seq_lens) for g in range(self.num_groups)]
        return self.model(input_ids, positions, metadata[0] if self.num_groups == 1 else metadata)


def name_lifted_constants(program: Any, paths: dict[tuple, str]) -> dict[str, torch.Tensor]:
    """Make the program's lifted tensor constants (plain tensors: quantized weights, KV caches) non-persistent
    buffers named `vx_constant_N`, and return every weight-like input of the program by the name the package gives
    it. Left as constants, the package would name them `_tensor_constantN` in the compiler's own order; buffers keep
    their names."""
    from torch.export.graph_signature import InputKind, InputSpec

    by_name: dict[str, torch.Tensor] = {}
    specs = program.graph_signature.input_specs
    for i, spec in enumerate(specs):
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            store = program.state_dict if spec.target in program.state_dict else program.constants
            by_name[spec.target] = store[spec.target]
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            name = f"vx_constant_{len(by_name)}"
            tensor = program.constants.pop(spec.target)
            program.constants[name] = tensor
            specs[i] = InputSpec(kind=InputKind.BUFFER, arg=spec.arg, target=name, persistent=False)
            by_name[name] = tensor
    unknown = [name for name, t in by_name.items() if _key(t) not in paths]
    if unknown:
        raise RuntimeError(f"constants of the program that are no tensor of the model: {unknown[:5]}")
    return by_name


def _key(t: torch.Tensor) -> tuple:
    """A tensor's identity as the package sees it (export may hand back another tensor object of the same data)."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def build_model(request: dict) -> tuple[torch.nn.Module, int]:
    """(the model, bound to its KV caches, number of KV-cache groups), as the engine built it."""
    import msgspec

    from vx.kv_spec import KVCacheGroupSpec
    from vx.config import decode_config
    from vx.gpu.attention.cpu_kernels import register_paged_decode_op
    from vx.gpu.model_runner import ModelRunner
    from vx.kernels import torch_ops

    with open(request["config"], "rb") as f:
        config = decode_config(f.read())
    groups = msgspec.json.decode(request["groups"].encode(), type=tuple[KVCacheGroupSpec, ...])
    # The engine's thread count: the generated loops' OpenMP teams are sized at compile time.
    torch.set_num_threads(request["threads"])
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    # VX_DECODE_COMPILE=off (set by the engine): the caches are bound, no graphs are made here.
    runner.initialize_kv_cache(request["num_blocks"], groups)
    torch_ops.library()
    register_paged_decode_op()
    return runner.model, max(1, len(groups))


def compile_package(request: dict) -> dict:
    """Export and AOT-compile the decode step of `request["size"]`; the sidecar's content."""
    from vx.gpu.graphs.aoti_cache import describe, named_tensors
    from vx.gpu.graphs.buffers import DecodeBuffers

    size = request["size"]
    model, num_groups = build_model(request)
    paths: dict[tuple, str] = {}
    for path, tensor in named_tensors(model).items():
        paths.setdefault(_key(tensor), path)
    step = DecodeStep(model, num_groups).eval()
    b = DecodeBuffers.allocate(size, request["max_blocks_per_seq"], torch.device("cpu"), num_groups)
    inputs = (b.input_ids, b.positions, b.seq_lens,
              *[t for g in range(num_groups) for t in (b.slot_mappings[g], b.block_tables[g])])
    t0 = time.perf_counter()
    with torch.no_grad():
        program = torch.export.export(step, inputs, strict=False)  # static shapes: one package per size
    by_name = name_lifted_constants(program, paths)
    from torch._inductor import aoti_compile_and_package

    # The package is written beside its final path and renamed: a reader sees a whole package or none.
    out = request["package"]
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".pt2", dir=os.path.dirname(out))
    os.close(fd)
    try:
        with torch.no_grad():
            aoti_compile_and_package(program, package_path=tmp, inductor_configs={
                "aot_inductor.package_constants_in_so": False,
                # The engine's buffers are fixed at allocation: the asserts could never fail.
                "size_asserts": False, "alignment_asserts": False,
                # The vector ISA this CPU reports, without inductor's probe builds (a C++ compile of seconds per
                # ISA on a machine whose inductor cache is empty): vx's own kernels already built with
                # -march=native here, and a compile that fails anyway falls back to in-process inductor.
                "cpp.vec_isa_ok": True})
        seconds = time.perf_counter() - t0
        loader = torch._C._aoti.AOTIModelPackageLoader(tmp, "model", False, 1, -1)
        wanted = loader.get_constant_fqns()
        constants = {}
        for fqn in wanted:
            tensor = by_name.get(fqn)
            if tensor is None:
                raise RuntimeError(f"the package wants constant {fqn!r}, which the program does not have")
            constants[fqn] = [paths[_key(tensor)], describe(tensor)]
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep a shared cache's package from other users
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    from vx.gpu.kv_cache import attention_layers

    return {"key": request["key"], "size": size, "num_groups": num_groups, "constants": constants,
            "compile_s": round(seconds, 2), "layers": len(attention_layers(model))}


def _die_with_parent() -> None:
    """Linux: be killed when the engine's thread that started this process ends (an engine that exits, even
    killed, leaves no compile behind)."""
    if sys.platform != "linux":
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the parent was gone before the prctl
        sys.exit(1)


def main(argv: list[str]) -> int:
    from vx.gpu.graphs.aoti_cache import sidecar_path

    # Below the engine: a compile runs beside its steps on the same cores.
    os.nice(10)
    _die_with_parent()
    with open(argv[0]) as f:
        request = json.load(f)
    sidecar = compile_package(request)
    sidecar["child_s"] = round(time.perf_counter() - _STARTED, 2)  # what the next first compile's estimate reads
    path = sidecar_path(request["package"])
    with open(path + ".tmp", "w") as f:
        json.dump(sidecar, f)
    os.replace(path + ".tmp", path)
    print(f"vx: decode graph of batch size {request['size']} compiled in {sidecar['compile_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
