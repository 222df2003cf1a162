"""Weight-only int4/int8 matmuls: every candidate kernel beside torch's float F.linear, at real layer shapes.

    python -m benchmarks.quant_matmul                         # all shapes, M 1,8,32, float32 and bfloat16
    python -m benchmarks.quant_matmul --shapes qkv,lm_head --batches 1 --dtypes float32 --layouts int4

For each layout vx packs (int4 groupwise, int8 groupwise, int8 per channel; groups of `--group-size`), each
shape (the default model's projections as vx fuses them, its LM head, and an 8B model's 4096x4096 and
14336x4096), each activation dtype and each M (rows of x), it times y = x @ W^T through:

- `float F.linear`: the float weight in x's dtype, the path a quantized weight replaces (the competitor);
- torch's own weight-only ops (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) with x in its dtype, and
  with a float32 x cast to bf16 and back;
- torchao's CPU weight-only layouts when torchao is installed (`pip install torchao==0.18.0`; on the CPU its
  int4 runs the same torch op as above, its int8 converts the whole weight to float per call);
- dequantizing the whole weight per call (the reference Int8Groupwise had), for int8 groupwise;
- vx's C kernel (`vx.kernels.quant_matmul`), its float path (float32 x times the weight dequantized in registers)
  and its int8 path (x rounded to int8 per group, VNNI integer dot products) side by side, its AMX path where the
  CPU has AMX (the weight dequantized to bf16 tiles per call, x in bf16), and the path vx chose
  (`Int4Groupwise` ... `.matmul`; `VX_CPU_MATMUL`). `--only-vx` keeps just these and float F.linear.

Weights rotate over copies totalling `--cold-mib` so each call reads its weight from memory, as a decode
step does (one weight per layer); candidates run interleaved, round after round, and a cell is the median
µs per call over `--rounds` rounds with its spread ((max - min) / median), then the ratio to float F.linear.
`err` is the largest |y - y_ref| / max |y_ref| over the table's rows, y_ref = float64 x @ W^T of the weight the
integers stand for (bf16 activations: x as given, rounded to bf16).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Table, parse_int_list, set_threads, torch_dtype

# SmolLM2-135M (vx's default model: hidden 576, 9 heads and 3 KV heads of 64, intermediate 1536, vocab 49152)
# as vx runs it (q/k/v and gate/up fused), and an 8B Llama's attention and MLP projections: name -> (N, K).
SHAPES: dict[str, tuple[int, int]] = {
    "qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576),
    "8b_4096x4096": (4096, 4096), "8b_14336x4096": (14336, 4096),
}
SHAPE_SETS = {"default": ["qkv", "o", "gate_up", "down", "lm_head"], "8b": ["8b_4096x4096", "8b_14336x4096"]}
LAYOUTS = {"int4": "int4 groupwise", "int8g": "int8 groupwise", "int8pc": "int8 per channel"}

Matmul = Callable[[Any], Any]


@dataclass
class Weights:
    """One layer's integers and the float weight they stand for (float32, for the competitor and the reference)."""

    q: Any
    scale: Any
    zero: Any
    group: int
    w32: Any


@dataclass
class Candidate:
    """A way to compute x @ W^T: `make(weights, dtype)` packs one copy and returns its matmul."""

    name: str
    make: Callable[[Weights, Any], Matmul]
    bytes_per_weight: float | None  # what a call reads per weight, to size the rotation (None: x's dtype)
    copies: list[Matmul] = field(default_factory=list)
    times: dict[int, list[float]] = field(default_factory=dict)  # M -> per-call seconds, one per round
    err: float = 0.0
    next_copy: int = 0


def make_weights(layout: str, n: int, k: int, group: int, seed: int) -> Weights:
    import torch

    g = torch.Generator().manual_seed(seed)
    if layout == "int8pc":
        group = k
    if layout == "int4":
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scale = torch.rand(n, k // group, generator=g) * 0.02 + 0.005
        zero = -8 * scale + torch.randn(n, k // group, generator=g) * 0.01
    else:
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand(n, k // group, generator=g) * 0.001 + 0.0002
        zero = torch.zeros_like(scale) if layout == "int8pc" else torch.randn(n, k // group, generator=g) * 0.005
    w32 = (q.view(n, -1, group).float() * scale[..., None] + zero[..., None]).view(n, k)
    return Weights(q, scale, zero, group, w32)


# ------------------------------------------------------------------------------------------------ candidates
def _float_linear(w: Weights, dtype: Any) -> Matmul:
    import torch.nn.functional as F

    weight = w.w32.to(dtype).clone()
    return lambda x: F.linear(x, weight)


def _torch_int4pack(via_bf16: bool) -> Callable[[Weights, Any], Matmul]:
    def make(w: Weights, dtype: Any) -> Matmul:
        import torch

        n, k = w.q.shape
        pad = -n % 16
        q = torch.nn.functional.pad(w.q.to(torch.int32), (0, 0, 0, pad))
        s, z = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (w.scale, w.zero))
        op_dtype = torch.bfloat16 if via_bf16 else dtype
        sz = torch.stack([s, z + 8 * s], dim=-1).transpose(0, 1).contiguous().to(op_dtype)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        op = torch.ops.aten._weight_int4pack_mm_for_cpu
        return lambda x: op(x.to(op_dtype), packed, w.group, sz)[:, :n].to(x.dtype)
    return make


def _torch_int8pack(via_bf16: bool) -> Callable[[Weights, Any], Matmul]:
    def make(w: Weights, dtype: Any) -> Matmul:
        import torch

        op_dtype = torch.bfloat16 if via_bf16 else dtype
        q, scale = w.q.clone(), w.scale[:, 0].to(op_dtype)
        return lambda x: torch.ops.aten._weight_int8pack_mm(x.to(op_dtype), q, scale).to(x.dtype)
    return make


def _dequantize_per_call(w: Weights, dtype: Any) -> Matmul:
    import torch.nn.functional as F

    q, s, z = w.q.clone(), w.scale.to(dtype), w.zero.to(dtype)
    n, k = q.shape

    def mm(x: Any) -> Any:
        weight = (q.view(n, -1, w.group).to(x.dtype) * s[..., None] + z[..., None]).view(n, k)
        return F.linear(x, weight)
    return mm


def _torchao(layout: str) -> Callable[[Weights, Any], Matmul]:
    def make(w: Weights, dtype: Any) -> Matmul:
        import torch
        from torchao.quantization import Int8WeightOnlyConfig, PerGroup, PerRow, quantize_

        n, k = w.q.shape
        lin = torch.nn.Linear(k, n, bias=False, dtype=dtype)
        lin.weight.data.copy_(w.w32)
        if layout == "int4":
            from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

            config: Any = PrototypeInt4WeightOnlyConfig(group_size=w.group)
        else:
            config = Int8WeightOnlyConfig(granularity=PerRow() if layout == "int8pc" else PerGroup(w.group))
        quantize_(lin, config)
        return lambda x: lin(x)
    return make


def _vx_kernel(layout: str, path: str) -> Callable[[Weights, Any], Matmul]:
    """vx's C kernel packed for `path` (`float` or `int8`, as VX_CPU_MATMUL would choose; `amx`: packed as `auto`
    does on an AMX CPU, its AMX path at every M)."""
    def make(w: Weights, dtype: Any) -> Matmul:
        import torch
        from vx.kernels.quant_matmul import load_quant_matmul_kernel

        kernel = load_quant_matmul_kernel()
        saved = os.environ.get("VX_CPU_MATMUL")
        os.environ["VX_CPU_MATMUL"] = "auto" if path == "amx" else path
        try:
            packed = kernel.pack(w.q, w.scale, w.zero, w.group, 4 if layout == "int4" else 8)
        finally:
            if saved is None:
                del os.environ["VX_CPU_MATMUL"]
            else:
                os.environ["VX_CPU_MATMUL"] = saved
        if path == "amx":
            if not packed.amx:
                raise ValueError("the AMX path does not serve this weight here")
            return lambda x: kernel.matmul(x.to(torch.float32), packed, amx=True).to(x.dtype)
        if packed.int8_activations != (path == "int8"):
            raise ValueError(f"the {path} path does not serve this weight here")
        return lambda x: kernel.matmul(x.to(torch.float32), packed, amx=False).to(x.dtype)
    return make


def _vx_chosen(layout: str) -> Callable[[Weights, Any], Matmul]:
    def make(w: Weights, dtype: Any) -> Matmul:
        from vx.models.layers.quantization.kernels import Int4Groupwise, Int8Groupwise, Int8PerChannel

        s, z = w.scale.to(dtype), w.zero.to(dtype)
        if layout == "int4":
            packed: Any = Int4Groupwise(w.q, s, z, w.group)
        elif layout == "int8g":
            packed = Int8Groupwise(w.q, s, z, w.group)
        else:
            packed = Int8PerChannel(w.q, s[:, 0])
        return packed.matmul
    return make


def candidates(layout: str, dtype_name: str, only_vx: bool = False) -> list[Candidate]:
    """The float competitor first, then every candidate that applies to `layout` with `dtype_name` activations
    (`only_vx`: vx's float and int8 paths and vx's choice, the competitor still first)."""
    import importlib.util

    from vx.kernels.quant_matmul import load_quant_matmul_kernel

    int_bytes = 0.5 if layout == "int4" else 1.0
    out = [Candidate("float F.linear", _float_linear, None)]
    fp32 = dtype_name == "float32"
    if layout == "int4":
        out.append(Candidate("torch int4pack", _torch_int4pack(False), int_bytes))
        if fp32:
            out.append(Candidate("torch int4pack, x via bf16", _torch_int4pack(True), int_bytes))
    elif layout == "int8pc":
        out.append(Candidate("torch int8pack", _torch_int8pack(False), int_bytes))
        if fp32:
            out.append(Candidate("torch int8pack, x via bf16", _torch_int8pack(True), int_bytes))
    else:
        out.append(Candidate("dequantize per call", _dequantize_per_call, None))
    if importlib.util.find_spec("torchao") is not None:
        name = {"int4": "int4 (opaque)", "int8g": "int8 PerGroup", "int8pc": "int8 PerRow"}[layout]
        out.append(Candidate("torchao " + name, _torchao(layout), int_bytes if layout == "int4" else None))
    kernel = load_quant_matmul_kernel()
    if kernel is not None:
        out.append(Candidate("vx C float path", _vx_kernel(layout, "float"), int_bytes))
        if (4 if layout == "int4" else 8) in kernel.i8_bits:
            out.append(Candidate("vx C int8 path", _vx_kernel(layout, "int8"), int_bytes))
        if kernel.has_amx:
            out.append(Candidate("vx C AMX path", _vx_kernel(layout, "amx"), int_bytes))
    if only_vx:
        out = [out[0], *(c for c in out if c.name.startswith("vx C"))]
    chosen_weight = _vx_chosen(layout)(make_weights(layout, 16, 64, 32, 0), torch_dtype(dtype_name)).__self__
    chosen = chosen_weight.kernel + (" int8" if getattr(getattr(chosen_weight, "_packed", None), "int8_activations",
                                                        False) else "")
    out.append(Candidate(f"vx chosen ({chosen})", _vx_chosen(layout), int_bytes))
    return out


# ------------------------------------------------------------------------------------------------- timing
def _pass(c: Candidate, x: Any, calls: int) -> float:
    """Seconds per call over `calls` calls, each on the next copy (round robin), so weights come cold."""
    t0 = time.perf_counter()
    for _ in range(calls):
        c.copies[c.next_copy % len(c.copies)](x)
        c.next_copy += 1
    return (time.perf_counter() - t0) / calls


def measure_table(layout: str, shape: str, dtype_name: str, batches: list[int], args: argparse.Namespace,
                  table: Table, errs: dict[str, float]) -> None:
    """Time every candidate at one shape and dtype for each M, interleaved, and add one row per M to `table`."""
    import torch

    n, k = SHAPES[shape]
    dtype = torch_dtype(dtype_name)
    w = make_weights(layout, n, k, args.group_size, args.seed)
    cands = candidates(layout, dtype_name, args.only_vx)
    gen = torch.Generator().manual_seed(args.seed + 1)
    xs = {m: torch.randn(m, k, generator=gen).to(dtype) for m in batches}
    slow: set[str] = set()
    w64 = w.w32.double()
    refs = {m: x.double() @ w64.T for m, x in xs.items()}
    del w64
    with torch.inference_mode():
        for c in cands:  # one copy, a warm-up call and the error of each M; then as many copies as keep it cold
            c.copies.append(c.make(w, dtype))
            t0 = time.perf_counter()
            c.copies[0](xs[max(batches)])
            t_call = time.perf_counter() - t0
            for m, x in xs.items():
                c.err = max(c.err, ((c.copies[0](x).double() - refs[m]).abs().max() / refs[m].abs().max()).item())
            if t_call > args.max_call_s:
                slow.add(c.name)
                continue
            one = n * k * (c.bytes_per_weight or dtype.itemsize)
            cold = max(1, min(args.max_copies, math.ceil(args.cold_mib * 2**20 / one)))
            c.copies += [c.make(w, dtype) for _ in range(cold - 1)]
        for m in batches:
            for _ in range(args.rounds):
                for c in cands:
                    if c.name in slow and c.times.get(m):
                        continue
                    est = statistics.median(c.times[m]) if c.times.get(m) else 1e-3
                    calls = 1 if c.name in slow else max(1, min(len(c.copies), int(args.pass_s / max(est, 1e-6))))
                    c.times.setdefault(m, []).append(_pass(c, xs[m], calls))
            base = statistics.median(cands[0].times[m])
            cells: list[Any] = [f"{shape} {n}x{k}", m]
            for c in cands:
                ts = c.times[m]
                med = statistics.median(ts)
                spread = "1 call" if c.name in slow else f"±{100 * (max(ts) - min(ts)) / med / 2:.0f}%"
                cells.append(f"{med * 1e6:,.0f} {spread}" + ("" if c is cands[0] else f" ({med / base:.2f}x)"))
            table.add(*cells)
    for c in cands:
        errs[c.name] = max(errs.get(c.name, 0.0), c.err)
    if not table.headers[2:]:
        table.headers += [c.name for c in cands]
    del cands


def machine_line() -> str:
    """CPU model, the vector/matrix units that matter here, cores, torch threads, load, OpenMP wait policy."""
    import torch

    from vx.platform import cpu_flags

    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    flags = set(cpu_flags())
    units = [u for u in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8") if u in flags]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{model}; {' '.join(units) or 'no AVX2'}{'' if 'avx512f' in flags else ', no AVX-512'}"
            f"{'' if 'amx_bf16' in flags else ', no AMX'}; {os.cpu_count()} cores, torch threads "
            f"{torch.get_num_threads()}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}; "
            f"load average {load:.2f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="vx bench quant_matmul", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="default,8b",
                    help=f"comma-separated names or sets: {', '.join(SHAPE_SETS)}, {', '.join(SHAPES)}")
    ap.add_argument("--layouts", default="int4,int8g,int8pc", help=f"comma-separated: {', '.join(LAYOUTS)}")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="activation dtypes")
    ap.add_argument("--batches", type=parse_int_list, default=[1, 8, 32], help="rows of x (default 1,8,32)")
    ap.add_argument("--group-size", type=int, default=32, help="input features per group (default 32)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per cell (default 5)")
    ap.add_argument("--pass-s", type=float, default=0.02, help="seconds of calls per candidate per round")
    ap.add_argument("--cold-mib", type=float, default=128, help="weight copies to rotate over, in MiB")
    ap.add_argument("--max-copies", type=int, default=256)
    ap.add_argument("--max-call-s", type=float, default=1.0,
                    help="a candidate slower than this per call is timed once (its warm-up call)")
    ap.add_argument("--only-vx", action="store_true",
                    help="only vx's C kernel paths side by side (float and int8 activations) and vx's choice, "
                         "besides float F.linear")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch (and kernel) threads (default: torch's)")
    args = ap.parse_args(argv)
    from vx.platform import prefer_openmp_wait_policy

    prefer_openmp_wait_policy()  # as in vx's engine process (no effect once torch is loaded)
    set_threads(args.threads)
    shapes = [s for name in args.shapes.split(",") if name.strip()
              for s in SHAPE_SETS.get(name.strip(), [name.strip()])]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; choose from {', '.join([*SHAPE_SETS, *SHAPES])}")
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    dtypes = [x.strip() for x in args.dtypes.split(",") if x.strip()]
    for x in layouts:
        if x not in LAYOUTS:
            ap.error(f"unknown layout {x!r}; choose from {', '.join(LAYOUTS)}")
    print(f"quant_matmul: {machine_line()}\n", flush=True)
    started = time.perf_counter()
    for layout in layouts:
        for dtype_name in dtypes:
            group = "" if layout == "int8pc" else f", groups of {args.group_size}"
            table = Table(f"{LAYOUTS[layout]}{group}, {dtype_name} activations: µs per call", ["shape (NxK)", "M"])
            errs: dict[str, float] = {}
            for shape in shapes:
                measure_table(layout, shape, dtype_name, args.batches, args, table, errs)
            table.add("err", "", *[f"{errs[h]:.1e}" for h in table.headers[2:]])
            table.notes.append(f"median of {args.rounds} interleaved rounds ± half the spread, (ratio to float "
                               f"F.linear); weights rotate over ~{args.cold_mib:g} MiB of copies")
            table.print()
    print(f"done in {time.perf_counter() - started:.0f} s; {machine_line()}", flush=True)


if __name__ == "__main__":
    main()
