"""One MoE layer's experts on CUDA: the Triton grouped GEMM (fused_moe_triton.py) beside FusedMoE's eager loop
(one matmul pair per active expert, the counts read on the host), on the same routing, in one run.

    python -m benchmarks.fused_moe                                  # both shapes, tokens 1,8,64,512, bfloat16
    python -m benchmarks.fused_moe --shapes qwen3_30b --tokens 1,8 --dtypes bfloat16,float32

Shapes are real experts: Qwen3-30B-A3B (128 experts, top 8, hidden 2048, intermediate 768) and Mixtral 8x7B
(8 experts, top 2, hidden 4096, intermediate 14336). Each cell is the median µs per layer call (routing included,
from the router logits) over `--min-time` seconds after a warm-up, then loop / triton (above 1.00x: triton is
faster). `err` is the largest |triton - loop| / max |loop|. Needs CUDA and triton.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import Table, measure, parse_int_list, ratio, torch_dtype  # noqa: E402

# name -> (experts, top_k, hidden, intermediate)
SHAPES = {"qwen3_30b": (128, 8, 2048, 768), "mixtral_8x7b": (8, 2, 4096, 14336)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {', '.join(SHAPES)}")
    ap.add_argument("--tokens", default="1,8,64,512", help="rows per call, comma-separated")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds timed per cell")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.fused_moe needs CUDA (the Triton path runs on CUDA tensors only).")
    from vx.models.layers.fused_moe import FusedMoE
    from vx.models.layers.fused_moe_triton import fused_experts

    for dtype_name in args.dtypes.split(","):
        dtype = torch_dtype(dtype_name)
        table = Table(f"MoE experts, {dtype_name}, {torch.cuda.get_device_name()}",
                      ["shape", "tokens", "loop µs", "triton µs", "loop/triton", "err"])
        for shape in args.shapes.split(","):
            experts, top_k, hidden, inter = SHAPES[shape]
            layer = FusedMoE(experts, top_k, hidden, inter, renormalize=True).to("cuda")
            with torch.no_grad():
                layer.w13_weight.normal_(std=hidden ** -0.5)
                layer.w2_weight.normal_(std=inter ** -0.5)
            layer = layer.to(dtype)
            for tokens in parse_int_list(args.tokens):
                x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
                logits = torch.randn(tokens, experts, device="cuda")

                def loop() -> torch.Tensor:
                    weights, ids = layer.route(logits, dtype)
                    return layer.forward_loop(x, weights, ids)

                def triton() -> torch.Tensor:
                    weights, ids = layer.route(logits, dtype)
                    return fused_experts(x, layer.w13_weight, layer.w2_weight, weights, ids)

                with torch.inference_mode():
                    want, got = loop().float(), triton().float()
                    err = float((got - want).abs().max() / want.abs().max())
                    t_loop = statistics.median(measure(loop, args.min_time, sync=torch.cuda.synchronize)) * 1e6
                    t_triton = statistics.median(measure(triton, args.min_time, sync=torch.cuda.synchronize)) * 1e6
                table.add(shape, tokens, round(t_loop, 1), round(t_triton, 1), ratio(t_loop, t_triton), f"{err:.1e}")
            del layer
            torch.cuda.empty_cache()
        table.print()


if __name__ == "__main__":
    main()
