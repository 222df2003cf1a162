"""CUDA-graph decode's logic on the CPU (vx.gpu.graphs.cuda.CudaGraphs with a stand-in for the capture): warm-up
before capture, one graph per size, replays that read the persistent buffers where they are and rewrite one output
tensor, and, through a whole engine, greedy tokens equal to eager decode with padded sizes and mixed steps eager.

A real capture needs CUDA (`benchmarks/gpu_check.sh` runs the engine with CUDA graphs on a GPU); the stand-in
records the call and replays it by running the same forward on the same argument tensors into the captured output,
which is what a CUDA graph's replay amounts to: if anything read a per-step tensor instead of the persistent
buffers, or a padding row reached sampling, the replays would give other tokens.
"""

from __future__ import annotations

import pytest
import torch

import vx
from tests.support.decode_graphs import runner
from vx.gpu.graphs import build
from vx.gpu.graphs.cuda import CudaGraphs


class StandInCapture:
    """Captures by calling the forward once; replays by calling it again on the captured arguments, writing into
    the captured output (a CUDA graph replays its kernels on the addresses it captured)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def __call__(self, forward, args, pool):
        size = args[1].shape[0]
        self.events.append(("capture", size))
        output = forward(*args)

        def replay() -> None:
            self.events.append(("replay", size))
            output.copy_(forward(*args))

        return replay, output


def test_a_size_is_warmed_up_then_captured_and_each_run_replays_into_one_output():
    calls: list[int] = []
    buffer = torch.zeros(8)

    def forward(model, x, positions, md):
        calls.append(x.shape[0])
        return x * 2

    capture = StandInCapture()
    graphs = CudaGraphs(forward, capture=capture)
    for size in (4, 2):
        graphs.build(size, (None, buffer[:size], None, None))
    assert calls == [4, 4, 2, 2]  # warm-up, then the capture's own call, per size
    assert capture.events == [("capture", 4), ("capture", 2)]
    buffer[:4] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    first = graphs.run(4, (None, buffer[:4], None, None))
    assert first.tolist() == [2.0, 4.0, 6.0, 8.0]
    buffer[:4] = torch.tensor([5.0, 6.0, 7.0, 8.0])  # the next step's inputs, written into the same buffer
    second = graphs.run(4, (None, buffer[:4], None, None))
    assert second is first and second.tolist() == [10.0, 12.0, 14.0, 16.0]
    assert capture.events[-2:] == [("replay", 4), ("replay", 4)]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_engine_with_captured_graphs_gives_eager_greedy_tokens(tiny_model_dirs, monkeypatch, family):
    """Decode steps of 3 requests run the graph of 4 (a padding row), steps of 1 and 2 their own; prefill and mixed
    steps stay eager; the tokens are eager decode's. Gemma 3 has two KV-cache groups (sliding and global layers),
    so its graphs carry a block table and slots per group."""
    tiny_model_dir = tiny_model_dirs[family]
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20], [21]]
    params = [vx.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 4, 9, 16)]

    def run(**engine_args):
        llm = vx.LLM(tiny_model_dir, dtype="float32", device="cpu", max_num_seqs=4, **engine_args)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            graphs = runner(llm).decode_graphs
            return [o.outputs[0].token_ids for o in outs], graphs
        finally:
            llm.shutdown()

    want, _ = run(enforce_eager=True)
    capture = StandInCapture()
    monkeypatch.setattr(build, "InductorGraphs", lambda forward, num_sizes: CudaGraphs(forward, capture))
    monkeypatch.setenv("VX_DECODE_COMPILE", "startup")
    monkeypatch.setenv("VX_DECODE_GRAPHS", "inductor")  # the stand-in replaces the in-process capture
    got, graphs = run()
    assert got == want
    assert len(graphs.buffers.block_tables) == (2 if family == "gemma3" else 1)
    assert graphs is not None and [e for e in capture.events if e[0] == "capture"] == [
        ("capture", 4), ("capture", 2), ("capture", 1)]  # largest first
    # Four requests decode together, then three (in the graph of 4), two, one.
    assert all(graphs.steps_run.get(size, 0) > 0 for size in (4, 2, 1)), graphs.steps_run
    assert graphs.steps_run[4] > 3  # three steps of four requests, then the three-request ones in the same graph
