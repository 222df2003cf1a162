"""GGUF weights read as stored against the repacked layouts and torch's CPU int4 ops, at 1.7B and 8B matrix shapes.

    python -m benchmarks.gguf_matmul                               # 1.7B and 8B matrices, batch 1
    python -m benchmarks.gguf_matmul --shapes 1.7b_gate --batches 1,4,16,64,512

Each matrix takes the type a Q4_K_M file gives it (v and down Q6_K, the others Q4_K; `--type` forces one), with
random blocks (small finite scales: valid data). Candidates, each y = x @ W^T for float32 x [M, K]:

- `as stored` (vx.kernels.gguf_matmul): the file's blocks, x rounded to int8 per block (the CPU's build: 512-bit
  VNNI code for Q4_K and Q6_K where it has AVX-512 VNNI), `as stored, 256-bit` (the same CPU, 256-bit code only)
  and `as stored, AVX2` (the build an AVX2-only CPU gets);
- `as stored, decoded panels`: the many-row way, chunks of the stored weight decoded per call into the int8
  kernel's panels; `as stored, vx's choice`: what `product` picks at that M (the panels from `many_rows(type)` rows on);
- `repacked int8`: vx's int8-activation kernel on the weight repacked at load (4-bit groups of 32 with float16 scale
  and zero for Q4_K, 8-bit groups of 16 for Q6_K): what vx ran before for VX_CPU_MATMUL=auto/int8;
- `repacked float`: the exact float path on the same repacked weight (VX_CPU_MATMUL=float);
- torch's `_weight_int4pack_mm_for_cpu` (Q4_K only, x in bf16, its fast dtype): needs its own repack (int4pack,
  bf16 scales and zeros per group of 32), exact up to bf16;
- torch's `_dyn_quant_matmul_4bit` (Q4_K only): symmetric int4 per group of 32 with no minimum, so Q4_K's
  minimums are dropped (an approximate weight, timed only); needs its own repack too.

Weights rotate over copies totalling `--cold-mib` so each call reads its weight from memory, as a decode step does;
candidates run interleaved round after round; a cell is the median µs per call over `--rounds` with its spread
((max - min) / median), the bits per weight the candidate's layout holds, and GB/s of the weight's bytes as the file
stores them per call (the same figure for every candidate: a rate of the file's weights, whatever a layout reads).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Table, parse_int_list, set_threads

Q4_K, Q6_K = 12, 14
# name -> (N, K, the GGML type a Q4_K_M file stores it in). 1.7B: hidden 2048, ffn 8192, 32 KV heads of 64;
# 8B: hidden 4096, ffn 14336, 8 KV heads of 128.
SHAPES: dict[str, tuple[int, int, int]] = {
    "1.7b_q": (2048, 2048, Q4_K), "1.7b_v": (2048, 2048, Q6_K), "1.7b_o": (2048, 2048, Q4_K),
    "1.7b_gate": (8192, 2048, Q4_K), "1.7b_down": (2048, 8192, Q6_K),
    "8b_q": (4096, 4096, Q4_K), "8b_k": (1024, 4096, Q4_K), "8b_v": (1024, 4096, Q6_K),
    "8b_gate": (14336, 4096, Q4_K), "8b_down": (4096, 14336, Q6_K),
}
_BLOCK = {Q4_K: (256, 144), Q6_K: (256, 210)}


def random_blocks(ggml_type: int, n: int, k: int, seed: int) -> Any:
    """n rows of random blocks of `ggml_type` (benchmarks.gguf_shapes' valid random blocks), uint8 [n, bytes]."""
    import numpy as np
    import torch

    from benchmarks.gguf_shapes import random_blocks as numpy_blocks

    return torch.from_numpy(numpy_blocks(ggml_type, n, k, np.random.default_rng(seed)))


@dataclass
class Candidate:
    name: str
    make: Callable[[Any, int], tuple[Callable[[Any], Any], int] | None]  # (blocks, type) -> (matmul, bytes) or None
    copies: list = field(default_factory=list)
    nbytes: int = 0  # what one copy of the weight holds in this candidate's layout
    times: dict[int, list[float]] = field(default_factory=dict)
    next_copy: int = 0


def _stored(vnni: bool, wide: bool = True) -> Callable:
    from vx.kernels.gguf_matmul import load_gguf_matmul_kernel

    def make(raw, ggml_type):
        kernel = load_gguf_matmul_kernel(vnni=vnni, wide=wide)
        if kernel is None or ggml_type not in kernel.types:
            return None
        return (lambda x: kernel.matmul(x, raw, ggml_type)), raw.nbytes
    return make


def _panels(raw, ggml_type):
    from vx.kernels.gguf_matmul import load_gguf_matmul_kernel
    from vx.kernels.quant_matmul import load_quant_matmul_kernel

    kernel, repacked = load_gguf_matmul_kernel(), load_quant_matmul_kernel()
    if kernel is None or not kernel.many_rows_serves(ggml_type, repacked):
        return None
    return (lambda x: kernel.matmul_many_rows(x, raw, ggml_type, repacked)), raw.nbytes


def _chosen(raw, ggml_type):
    from vx.kernels.gguf_matmul import load_gguf_matmul_kernel

    kernel = load_gguf_matmul_kernel()
    return None if kernel is None else ((lambda x: kernel.product(x, raw, ggml_type)), raw.nbytes)


def _repacked(mode: str) -> Callable:
    from vx.kernels.quant_matmul import load_quant_matmul_kernel
    from vx.models.layers.quantization.gguf_blocks import unpack

    def make(raw, ggml_type):
        kernel = load_quant_matmul_kernel()
        if kernel is None:
            return None
        g = unpack(raw, ggml_type)
        old = os.environ.get("VX_CPU_MATMUL")
        os.environ["VX_CPU_MATMUL"] = mode
        try:
            packed = kernel.pack(g.q, g.scale, g.zero, g.group_size, g.bits)
        finally:
            os.environ.pop("VX_CPU_MATMUL") if old is None else os.environ.__setitem__("VX_CPU_MATMUL", old)
        if (mode == "int8") != packed.int8_activations:
            return None
        return (lambda x: kernel.matmul(x, packed, amx=False)), packed.nbytes
    return make


def _torch_int4pack(raw, ggml_type):
    import torch

    from vx.models.layers.quantization.gguf_blocks import unpack

    if ggml_type != Q4_K:
        return None
    g = unpack(raw, ggml_type)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(g.q.to(torch.int32), 2)
    sz = torch.stack([g.scale, g.zero + 8 * g.scale], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return ((lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, 32, sz).float()),
            packed.nbytes + sz.nbytes)


def _torch_dyn_quant(raw, ggml_type):
    import torch

    from vx.models.layers.quantization.gguf_blocks import unpack

    if ggml_type != Q4_K:
        return None
    g = unpack(raw, ggml_type)
    n, k = g.q.shape
    nibbles = g.q.to(torch.uint8)
    packed = torch.ops.aten._dyn_quant_pack_4bit_weight((nibbles[:, 1::2] << 4) | nibbles[:, 0::2],
                                                        g.scale.contiguous(), None, 32, k, n)
    return (lambda x: torch.ops.aten._dyn_quant_matmul_4bit(x, packed, 32, k, n)), packed.nbytes


CANDIDATES = {
    "stored": ("as stored", _stored(True)),
    "stored_256": ("as stored, 256-bit", _stored(True, wide=False)),
    "stored_avx2": ("as stored, AVX2", _stored(False)),
    "panels": ("as stored, decoded panels", _panels),
    "chosen": ("as stored, vx's choice", _chosen),
    "repacked_int8": ("repacked int8", _repacked("int8")),
    "repacked_float": ("repacked float", _repacked("float")),
    "int4pack": ("torch int4pack (bf16 x)", _torch_int4pack),
    "dyn_quant": ("torch dyn_quant_4bit", _torch_dyn_quant),
}


def _cpu_line() -> str:
    name, flags = platform.processor() or "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    have = ", ".join(f for f in ("avx2", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags)
    return f"{name} ({have})"


def run_shape(name: str, ggml_type: int, cands: list[Candidate], batches: list[int], rounds: int, cold_mib: float,
              pass_s: float) -> Table:
    import torch

    n, k, _ = SHAPES[name]
    block, size = _BLOCK[ggml_type]
    weight_bytes = n * k // block * size
    copies = max(1, min(64, int(cold_mib * 2**20 // weight_bytes)))
    live = []
    for c in cands:
        c.copies, c.times, c.next_copy = [], {}, 0
        for i in range(copies):
            made = c.make(random_blocks(ggml_type, n, k, seed=i), ggml_type)
            if made is None:
                break
            c.copies.append(made[0])
            c.nbytes = made[1]
        if c.copies:
            live.append(c)
    xs = {m: torch.randn(m, k, generator=torch.Generator().manual_seed(m)) for m in batches}
    for c in live:  # warm up: builds, first touches
        for m in batches:
            c.copies[0](xs[m])
    for _ in range(rounds):
        for m in batches:
            for c in live:
                calls, t0 = 0, time.perf_counter()
                while True:
                    c.copies[c.next_copy](xs[m])
                    c.next_copy = (c.next_copy + 1) % len(c.copies)
                    calls += 1
                    if time.perf_counter() - t0 >= pass_s and calls >= 2:
                        break
                c.times.setdefault(m, []).append((time.perf_counter() - t0) / calls)
    type_name = "Q4_K" if ggml_type == Q4_K else "Q6_K"
    table = Table(f"{name}: {n}x{k} {type_name} ({weight_bytes / 2**20:.1f} MiB as stored)",
                  ["candidate", "M", "µs per call", "spread", "bits per weight", "GB/s (stored bytes)",
                   "vs as stored"])
    for m in batches:
        base = statistics.median(live[0].times[m]) if live and live[0].name == "as stored" else None
        for c in live:
            t = c.times[m]
            med = statistics.median(t)
            table.add(c.name, m, round(med * 1e6, 1), f"{(max(t) - min(t)) / med:.0%}",
                      round(8 * c.nbytes / (n * k), 2), round(weight_bytes / med / 1e9, 2),
                      f"{med / base:.2f}x" if base else "")
    table.notes.append(f"{copies} copies rotated, {rounds} interleaved rounds; 'vs as stored': time ratio (>1 slower).")
    return table


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of " + ", ".join(SHAPES))
    p.add_argument("--type", choices=["Q4_K", "Q6_K"], default=None, help="force one type for every shape")
    p.add_argument("--batches", default="1", help="rows of x (M), comma-separated")
    p.add_argument("--candidates", default=",".join(CANDIDATES), help="of " + ", ".join(CANDIDATES))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--pass-s", type=float, default=0.1, help="seconds each candidate runs per round and M")
    p.add_argument("--cold-mib", type=float, default=256.0, help="weight copies rotated per candidate, in MiB")
    p.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: torch's)")
    args = p.parse_args(argv)
    set_threads(args.threads)
    import torch

    cands = [Candidate(CANDIDATES[c][0], CANDIDATES[c][1]) for c in args.candidates.split(",")]
    print(f"CPU: {_cpu_line()}; torch threads {torch.get_num_threads()}\n")
    for name in args.shapes.split(","):
        forced = {"Q4_K": Q4_K, "Q6_K": Q6_K}.get(args.type or "")
        run_shape(name, forced or SHAPES[name][2], cands, parse_int_list(args.batches), args.rounds, args.cold_mib,
                  args.pass_s).print()


if __name__ == "__main__":
    main()
