"""Compiled decode (vx.gpu.graphs.decode_graphs): compiled and eager decode give Hugging Face's greedy tokens, a
size compiles in the background only once needed and the engine is idle, and shutting down stops the compiler."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch

import vx
from tests.support.kernel_cache import share_kernels
from tests.support.decode_graphs import TINY_KV_BLOCKS, greedy_prompts, hf_greedy, runner, vx_greedy
from vx.gpu.graphs import decode_graphs
from vx.gpu.graphs.decode_graphs import IDLE_BEFORE_COMPILE_S, DecodeGraphs


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["float", "gguf-q4_1-int8", "gguf-q4_k_m-stored"])
def test_compiled_and_eager_decode_equal_hf_greedy(tiny_model_dirs, tiny_gguf, monkeypatch, weights):
    """Float32: compiled decode (every size compiled before serving), eager decode and HF generate agree token for
    token. Seven prompts with max_num_seqs=4 and a KV cache of 12 blocks of 8 tokens make decode steps of 4
    requests, of 3 (the graph of 4 with a padding row), of 2 and 1, next to prefill and mixed steps that stay
    eager, and preemptions (their prompts computed again). GGUF weights on the C kernel's int8-activation path (x rounded to int8 per group: near-tied tokens
    may differ from HF's): the compiled graphs still give eager's tokens exactly, since each row's product depends on
    that row alone. A Q4_K_M file's weights, kept as stored, reach their kernel through `vx::gguf_matmul` in the
    compiled graphs and give the tokens of an eager run of the same schedule. The GGUF engines get the graph of 4
    alone, which then serves every decode step, of 1 to 4 requests (up to 3 padding rows): what they check is the
    kernels inside a graph and rows that stay apart, which the padded graph shows, and each size's compile costs
    seconds (every size of a GGUF model compiled, on the exact float path against HF: test_aoti_loader.py, which
    serves them from an engine process of its own; no test compiles one twice for the same check)."""
    if weights == "float":
        model, reference_dir = tiny_model_dirs["llama"], tiny_model_dirs["llama"]
    else:
        tiny = tiny_gguf("Q4_K_M" if weights == "gguf-q4_k_m-stored" else "Q4_1")
        model, reference_dir = tiny.gguf_path, tiny.float_dir
    if weights == "gguf-q4_1-int8":
        from vx.kernels.quant_matmul import load_quant_matmul_kernel

        kernel = load_quant_matmul_kernel()
        if kernel is None or 4 not in kernel.i8_bits:
            pytest.skip("no int8-activation path for 4-bit weights here")
    if weights == "gguf-q4_k_m-stored":
        from vx.kernels.gguf_matmul import load_gguf_matmul_kernel

        kernel = load_gguf_matmul_kernel()
        if kernel is None or not kernel.types:
            pytest.skip("no GGUF as-stored kernel here")
    int8 = weights != "float"
    monkeypatch.setenv("VX_CPU_MATMUL", "int8" if int8 else "float")
    prompts = greedy_prompts(300)  # within every tiny model's vocabulary
    # The as-stored weights' eager run schedules as the compiled one below (preemptions included): a preempted
    # request's prompt computed again as a prefill (another attention path, another kernel's float rounding, and
    # from 32 rows for some types the many-row way, which rounds x per group rather than per block) is not the
    # decode steps' arithmetic, and x's int8 rounding can turn such float differences into another token.
    small_kv = dict(num_kv_blocks=12, block_size=8, max_model_len=64) if weights == "gguf-q4_k_m-stored" else {}
    eager, eager_steps = vx_greedy(model, prompts, enforce_eager=True, **small_kv)
    want = eager if int8 else hf_greedy(reference_dir, prompts)
    assert eager_steps == {}
    monkeypatch.setenv("VX_DECODE_COMPILE", "startup")
    if int8:
        monkeypatch.setattr(decode_graphs, "capture_sizes", lambda max_num_seqs, device_type: [max_num_seqs])
    preemptions: list[int] = []
    compiled, compiled_steps = vx_greedy(model, prompts, preemptions, num_kv_blocks=12, block_size=8,
                                          max_model_len=64)
    for i, w in enumerate(want):
        assert eager[i] == w, f"eager, prompt {i}"
        assert compiled[i] == w, f"compiled, prompt {i}"
    assert compiled_steps.get(4, 0) > 0, compiled_steps  # the graphs served, the padded one of 3 requests included
    assert preemptions[0] > 0


def test_steps_run_eagerly_until_their_size_is_compiled(tiny_model_dir, tiny_package, monkeypatch, tmp_path):
    """In the background mode, a decode step whose size has no graph yet runs eagerly and queues the size; mixed
    steps never use a graph. (Size 1's package comes from `tiny_package`'s cache, the same key: only size 2 is
    compiled here.)"""
    shutil.copytree(tiny_package[0], tmp_path, dirs_exist_ok=True)
    monkeypatch.setenv("VX_CACHE_DIR", str(tmp_path))
    share_kernels(tmp_path)
    monkeypatch.setenv("VX_DECODE_COMPILE", "background")
    llm = vx.LLM(tiny_model_dir, dtype="float32", device="cpu", max_num_seqs=4, num_kv_blocks=TINY_KV_BLOCKS)
    try:
        graphs = runner(llm).decode_graphs
        assert graphs is not None and graphs.sizes == [1, 2, 4]
        assert graphs.wait(timeout=600)  # size 1, queued at start-up
        assert graphs.ready_sizes == [1]
        params = vx.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
        # Two requests decode together: size 2 was queued by the first such step, which ran eagerly.
        assert graphs.steps_run.get(2, 0) < 5
        assert graphs.wait(timeout=600)
        assert 2 in graphs.ready_sizes
    finally:
        llm.shutdown()


class _SlowBuild:
    """A graph capture whose builds take a while, recording which sizes were started and finished."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.started, self.finished = seconds, [], []

    def build(self, size, args):
        self.started.append(size)
        time.sleep(self.seconds)
        self.finished.append(size)

    def run(self, size, args):
        raise AssertionError("not run here")


def test_shutdown_waits_for_the_compile_in_progress_and_drops_the_queued_ones():
    """A process that exits in the middle of an inductor compile aborts ("terminate called without an active
    exception", seen in 1 of 2 runs of a benchmark that shut an engine down and exited while size 1 compiled):
    shutdown drops the sizes still queued at once, and `wait=True` (what the exit does) waits for the one being
    compiled."""
    capture = _SlowBuild(0.5)
    graphs = DecodeGraphs(torch.nn.Identity(), 8, 4, torch.device("cpu"), capture=capture)
    for size in (1, 2, 4):
        graphs.compile_in_background(size)
    deadline = time.monotonic() + 5
    while not capture.started and time.monotonic() < deadline:
        time.sleep(0.01)
    graphs.shutdown()  # returns at once: the compile in progress goes on
    assert capture.started == [1] and capture.finished == []
    graphs.shutdown(wait=True)
    assert capture.started == capture.finished == [1]
    assert graphs._compiler.thread is None
    graphs.compile_in_background(8)  # refused once shut down
    time.sleep(0.1)
    assert capture.started == [1]


def test_the_compile_thread_ends_when_nothing_is_queued():
    """A thread that ran torch's parallel ops keeps an OpenMP team while it lives, and more OpenMP threads than
    cores stop libgomp's spinning for every step after: so the compiler's thread ends once its queue is empty,
    and a size needed later starts another."""
    capture = _SlowBuild(0.05)
    graphs = DecodeGraphs(torch.nn.Identity(), 8, 4, torch.device("cpu"), capture=capture)
    for size in (1, 2):
        graphs.compile_in_background(size)
    assert graphs.wait(timeout=5)
    deadline = time.monotonic() + 5
    while graphs._compiler.thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert graphs._compiler.thread is None
    assert not any(t.name == "vx-decode-compile" for t in threading.enumerate())
    graphs.compile_in_background(4)
    assert graphs.wait(timeout=5) and capture.finished == [1, 2, 4]
    graphs.shutdown(wait=True)


def test_a_queued_size_compiles_only_once_the_engine_is_idle():
    """A compile beside busy steps holds the GIL and slows them for its tens of seconds: a queued size waits until
    no step has run for IDLE_BEFORE_COMPILE_S; shut down while waiting, it never compiles."""
    capture = _SlowBuild(0.01)
    graphs = DecodeGraphs(torch.nn.Identity(), 8, 4, torch.device("cpu"), capture=capture)
    with graphs.step():
        graphs.compile_in_background(2)
        time.sleep(IDLE_BEFORE_COMPILE_S + 0.3)
        assert capture.started == []  # a long step (a prefill) is not idle time
    ended = time.monotonic()
    assert graphs.wait(timeout=5) and capture.finished == [2]
    assert time.monotonic() - ended >= IDLE_BEFORE_COMPILE_S
    with graphs.step():
        graphs.compile_in_background(4)
    graphs.shutdown(wait=True)  # while 4 waits for idle time: the waiting thread ends, nothing compiles
    assert capture.started == [2] and graphs._compiler.thread is None
