"""The child process that AOT-compiles one CPU decode graph (`vx.gpu.aoti_graphs` runs it; never imported there).

    python -m vx.gpu.aoti_compile REQUEST.json

It rebuilds the engine's model runner from the engine's own config (the same model file, dtype, quantization, KV
cache blocks and groups: the graph bakes their shapes in), exports the decode forward at one padded batch size
and compiles it with AOTInductor into a package without its weights: the engine hands it its own tensors (weights
and KV caches) when it loads it. The compiler (torch._dynamo, torch._inductor: ~200 MiB resident) thus lives and
dies here, never in the engine. Writes PACKAGE and its sidecar (`aoti_graphs.sidecar_path`) atomically, the
sidecar last; exits non-zero on any failure.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch


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


def register_plain_tensors(model: torch.nn.Module) -> int:
    """Make every plain tensor attribute of the model's modules (quantized weights, KV caches) a non-persistent
    buffer under the same name, so that the package names it by its module path (`aoti_graphs.named_tensors`), as
    parameters are: export lifts plain tensors as anonymous constants (`_tensor_constantN` in the package) whose
    order is the compiler's. The model is this process's own copy; how it computes does not change."""
    count = 0
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                delattr(module, name)
                module.register_buffer(name, value, persistent=False)
                count += 1
    return count


def build_model(request: dict) -> tuple[torch.nn.Module, int]:
    """(the model, bound to its KV caches, number of KV-cache groups), as the engine built it."""
    import msgspec

    from vx.cache.block_table_group import KVCacheGroupSpec
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
    from vx.gpu.aoti_graphs import MODEL_PREFIX, named_tensors
    from vx.gpu.decode_graphs import DecodeBuffers

    size = request["size"]
    model, num_groups = build_model(request)
    register_plain_tensors(model)
    tensors = named_tensors(model)
    step = DecodeStep(model, num_groups).eval()
    b = DecodeBuffers.allocate(size, request["max_blocks_per_seq"], torch.device("cpu"), num_groups)
    inputs = (b.input_ids, b.positions, b.seq_lens,
              *[t for g in range(num_groups) for t in (b.slot_mappings[g], b.block_tables[g])])
    t0 = time.perf_counter()
    with torch.no_grad():
        program = torch.export.export(step, inputs, strict=False)  # static shapes: one package per size
    # Anything export still lifted as an anonymous constant would get a name we cannot map: refuse.
    # (Non-persistent buffers are among the program's constants too, by their own names.)
    anonymous = [name for name, value in program.constants.items()
                 if isinstance(value, torch.Tensor) and name.removeprefix(MODEL_PREFIX) not in tensors]
    if anonymous:
        raise RuntimeError(f"tensors reached other than as module attributes: {anonymous[:5]}")
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
                "size_asserts": False, "alignment_asserts": False})
        seconds = time.perf_counter() - t0
        loader = torch._C._aoti.AOTIModelPackageLoader(tmp, "model", False, 1, -1)
        wanted = loader.get_constant_fqns()
        constants = {}
        for fqn in wanted:
            name = fqn.removeprefix(MODEL_PREFIX)
            tensor = tensors.get(name) if fqn.startswith(MODEL_PREFIX) else None
            if tensor is None:
                raise RuntimeError(f"the package wants constant {fqn!r}, which is no tensor of the model")
            constants[name] = describe(tensor)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep a shared cache's package from other users
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return {"key": request["key"], "size": size, "num_groups": num_groups, "constants": constants,
            "compile_s": round(seconds, 2)}


def describe(tensor: torch.Tensor) -> list:
    """What the package assumes of a constant: shape, strides, dtype (checked again when the engine loads it)."""
    return [list(tensor.shape), list(tensor.stride()), str(tensor.dtype)]


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
    from vx.gpu.aoti_graphs import sidecar_path

    # Below the engine: a compile runs beside its steps on the same cores.
    os.nice(10)
    _die_with_parent()
    with open(argv[0]) as f:
        request = json.load(f)
    sidecar = compile_package(request)
    path = sidecar_path(request["package"])
    with open(path + ".tmp", "w") as f:
        json.dump(sidecar, f)
    os.replace(path + ".tmp", path)
    print(f"vx: decode graph of batch size {request['size']} compiled in {sidecar['compile_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
