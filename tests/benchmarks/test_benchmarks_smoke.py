"""Smoke test of the benchmark suite: every benchmark's `main()` runs end to end at the tiniest sizes.

These check that the scripts work and print their comparison, never how fast anything is.
"""

from __future__ import annotations

import pytest

from benchmarks import BENCHMARKS, get_main
from benchmarks import run_all
from benchmarks.common import (RANDOM_MODEL_SHAPES, Table, build_random_model, make_workload, percentile,
                               poisson_arrivals)
from tests.support.kernel_cache import share_kernels

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory) -> str:
    """A random 2-layer model (hidden 64) with the tiny tokenizer."""
    return build_random_model("micro", str(tmp_path_factory.mktemp("bench-micro")))


def test_every_benchmark_has_a_main():
    for name in BENCHMARKS:
        assert callable(get_main(name))


def test_common_helpers():
    wl = make_workload(5, (3, 7), (2, 4), (10, 20), seed=1)
    assert wl == make_workload(5, (3, 7), (2, 4), (10, 20), seed=1)  # seeded
    assert all(3 <= len(p) <= 7 and all(10 <= t < 20 for t in p) for p in wl.prompts)
    assert all(2 <= n <= 4 for n in wl.output_lens)
    arrivals = poisson_arrivals(10, 5.0, seed=0)
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    t = Table("T", ["a", "b"])
    t.add("x", 1.234)
    assert "| x " in t.render() and "1.23" in t.render()


def test_engine_overhead(capsys):
    get_main("engine_overhead")(["--num-running", "4,8", "--steps", "3", "--min-prompt-len", "4",
                                 "--max-prompt-len", "20", "--block-size", "4"])
    out = capsys.readouterr().out
    assert "scheduler + KV vs 30 µs target" in out and "prepare" in out


def test_roofline(micro_model, capsys):
    get_main("roofline")(["--model", micro_model, "--dtypes", "float32", "--batches", "1,4", "--min-time", "0.001",
                          "--vx-batch", "2", "--vx-prompt-len", "4", "--vx-output-len", "3"])
    out = capsys.readouterr().out
    assert "peak GFLOP/s" in out and "fraction of roofline" in out


def test_roofline_tokens_per_s(micro_model):
    from benchmarks.roofline import roofline_tokens_per_s

    one = roofline_tokens_per_s(micro_model, 1, "float32", "cpu", min_time=0.001)
    assert one > 0


def test_throughput(micro_model, capsys):
    get_main("throughput")(["--model", micro_model, "--num-requests", "3", "--min-prompt-len", "4",
                            "--max-prompt-len", "12", "--min-output-len", "2", "--max-output-len", "4",
                            "--hf-batch-sizes", "1,2", "--hf-probe-tokens", "2"])
    out = capsys.readouterr().out
    assert "HF generate" in out and "vs HF" in out and "of the decode roofline" in out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_check(micro_model, capsys, dtype):
    rc = get_main("greedy_check")(["--model", micro_model, "--device", "cpu", "--dtype", dtype, "--num-prompts", "2",
                                   "--max-tokens", "6", "--min-agreement", "0.5"])
    out = capsys.readouterr().out
    assert rc == 0 and "top-1 agreement with Hugging Face: " in out and "-> OK" in out
    if dtype == "float32":
        assert "12/12 = 1.0000" in out


def test_prefix_caching(micro_model, capsys):
    get_main("prefix_caching")(["--model", micro_model, "--num-requests", "2", "--prefix-len", "32",
                                "--suffix-len", "2", "--output-len", "2"])
    out = capsys.readouterr().out
    assert "| on " in out and "| off " in out and "speed-up" in out


def test_streaming(micro_model, capsys):
    get_main("streaming")(["--model", micro_model, "--num-requests", "3", "--rate", "50", "--min-prompt-len", "4",
                           "--max-prompt-len", "8", "--output-len", "3"])
    out = capsys.readouterr().out
    assert "TTFT p99 ms" in out and "AsyncLLM / in-process" in out


def test_run_all_writes_a_report(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_all, "QUICK", [("engine_overhead", ["--num-running", "4", "--steps", "2",
                                                                "--min-prompt-len", "4", "--max-prompt-len", "8"])])
    report = tmp_path / "report.md"
    run_all.main(["--out", str(report)])
    text = report.read_text()
    assert "## engine_overhead" in text and "### Summary" in text and "FAILED" not in text
    assert run_all.plan(True, ["throughput"], "micro", []) == [("throughput", ["--model", "micro"])]


def test_async_overhead(micro_model, capsys):
    get_main("async_overhead")(["--model", micro_model, "--num-requests", "2", "--sequential", "1",
                                "--prompt-len", "4", "--output-len", "3"])
    out = capsys.readouterr().out
    assert "in-process" in out and "AsyncLLM" in out


def test_startup(micro_model, capsys):
    get_main("startup")(["--model", micro_model, "--runs", "1"])
    out = capsys.readouterr().out
    assert "first token (s)" in out and "median time to first streamed token" in out
    assert "after answer (MiB)" in out and "settled above bare torch (MiB)" in out
    assert "cache-filling start" in out  # reported apart from the table's cached starts


def test_decode_step(micro_model, capsys):
    get_main("decode_step")(["--model", micro_model, "--batch", "3", "--context", "20", "--steps", "2",
                             "--backends", "torch,cpu", "--profile"])
    out = capsys.readouterr().out
    assert "Decode step" in out and "| cpu " in out and "| torch " in out and "torch.profiler" in out


@pytest.mark.slow
def test_decode_step_compiled_with_breakdown(micro_model, capsys):
    # Batch 1: its graph is the one a fresh engine compiles anyway, so the compiled mode costs one compile, not two.
    get_main("decode_step")(["--model", micro_model, "--batch", "1", "--context", "12", "--steps", "2",
                             "--repeats", "1", "--backends", "cpu", "--modes", "eager,compiled", "--breakdown"])
    out = capsys.readouterr().out
    assert "| cpu, eager " in out and "| cpu, compiled " in out
    table = out.partition("### Where a step goes")[2]
    for part in ("layers' quantized matmuls", "LM head", "attention kernel", "rest of forward", "sampling",
                 "engine outside the model", "total"):
        assert f"| {part} " in table


def test_decode_step_per_batch_size(micro_model, capsys):
    get_main("decode_step")(["--model", micro_model, "--batch", "1,3", "--context", "12", "--steps", "1",
                             "--repeats", "2", "--backends", "torch"])
    out = capsys.readouterr().out
    assert "| torch, batch 1 " in out and "| torch, batch 3 " in out and "vs torch, batch 1" in out


def test_decode_step_per_cpu_matmul(micro_model, capsys):
    get_main("decode_step")(["--model", micro_model, "--batch", "2", "--context", "12", "--steps", "1",
                             "--repeats", "1", "--backends", "torch", "--cpu-matmuls", "float,int8"])
    out = capsys.readouterr().out
    assert "| torch, float matmul " in out and "| torch, int8 matmul " in out


def test_quant_matmul_paths_side_by_side(capsys):
    from vx.kernels.quant_matmul import load_quant_matmul_kernel

    kernel = load_quant_matmul_kernel()
    if kernel is None:
        pytest.skip("the CPU kernel cannot be built here")
    get_main("quant_matmul")(["--shapes", "o", "--batches", "1,3", "--rounds", "1", "--pass-s", "0.001",
                              "--cold-mib", "1", "--layouts", "int4", "--dtypes", "float32", "--only-vx"])
    out = capsys.readouterr().out
    assert "vx C float path" in out and "vx chosen" in out and "torch int4pack" not in out
    assert ("vx C int8 path" in out) == (4 in kernel.i8_bits)


def test_gguf_matmul(capsys):
    from vx.kernels.gguf_matmul import load_gguf_matmul_kernel

    if load_gguf_matmul_kernel() is None:
        pytest.skip("the CPU kernel cannot be built here")
    get_main("gguf_matmul")(["--shapes", "1.7b_q,1.7b_v", "--batches", "1,3", "--rounds", "1", "--pass-s", "0.001",
                             "--cold-mib", "1"])
    out = capsys.readouterr().out
    assert "Q4_K" in out and "Q6_K" in out and "| as stored " in out and "| repacked int8 " in out
    assert "torch int4pack" in out and "CPU:" in out


def test_prefill_chunk(micro_model, capsys):
    get_main("prefill_chunk")(["--model", micro_model, "--budgets", "8,32", "--prompt-len", "40", "--rounds", "2"])
    out = capsys.readouterr().out
    assert "Prefill chunk" in out and "| 8 " in out and "| 32 " in out and "ms per step" in out


def test_quant_matmul(capsys):
    get_main("quant_matmul")(["--shapes", "o", "--batches", "1,3", "--rounds", "1", "--pass-s", "0.001",
                              "--cold-mib", "1", "--group-size", "64"])
    out = capsys.readouterr().out
    for layout in ("int4 groupwise", "int8 groupwise", "int8 per channel"):
        assert f"{layout}" in out
    assert "float F.linear" in out and "vx chosen" in out and "torch int4pack" in out and "| err " in out
    assert "torch threads" in out  # the machine is named


def test_hf_quantization(micro_model, capsys):
    get_main("hf_quantization")(["--model", micro_model, "--prompts", "2", "--rounds", "1", "--e2e-rounds", "1",
                                 "--decode-tokens", "4"])
    out = capsys.readouterr().out
    assert "int4 (shipped: groups of 32)" in out and "fp8 -> int8 per channel" in out
    assert "Batch-1 decode through the engine" in out and "vs float" in out


def test_decode_step_per_kv_cache_dtype(micro_model, capsys):
    get_main("decode_step")(["--model", micro_model, "--batch", "2", "--context", "12", "--steps", "1",
                             "--repeats", "2", "--backends", "cpu", "--kv-cache-dtypes", "auto,fp8_e4m3,int8"])
    out = capsys.readouterr().out
    shape = RANDOM_MODEL_SHAPES["micro"]
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    rows_per_token = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"]  # K and V of every layer
    rows = [line for line in out.splitlines() if line.startswith("| cpu, kv ")]
    assert [r.split("|")[1].strip() for r in rows] == ["cpu, kv auto", "cpu, kv fp8_e4m3", "cpu, kv int8"]
    # float32, fp8, int8 (+ a 4-byte scale per row) bytes of a token's K and V
    assert [int(r.split("|")[5]) for r in rows] == [rows_per_token * b for b in (4 * head_dim, head_dim, head_dim + 4)]


def test_kv_cache_dtype(micro_model, capsys):
    get_main("kv_cache_dtype")(["--model", micro_model, "--max-tokens", "3", "--attention-rounds", "2",
                                "--attention-batch", "2", "--attention-context", "20"])
    accuracy, _, attention = capsys.readouterr().out.partition("### Decode attention, all 2 layers")
    assert "| int8 " in attention
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in accuracy.splitlines()
            if r.startswith("| auto") or r.startswith("| fp8") or r.startswith("| int8")}
    assert list(rows) == ["auto", "fp8_e4m3", "int8"]
    assert rows["auto"][1:4] == ["1.00x", "0.00%", "0.00%"] and rows["auto"][4] == "8/8"
    assert rows["fp8_e4m3"][1] == "0.25x" and float(rows["int8"][2][:-1]) < float(rows["fp8_e4m3"][2][:-1])


def test_quantization(tmp_path, capsys):
    import gguf

    from tests.support.tiny_gguf import uniform, write_tiny_gguf

    write_tiny_gguf(tmp_path, uniform(gguf.GGMLQuantizationType.Q4_0))
    get_main("quantization")(["--gguf", str(tmp_path / "model.gguf"), "--float-model", str(tmp_path / "float"),
                              "--formats", "gguf,float,int4", "--rounds", "1", "--decode-tokens", "4",
                              "--num-requests", "2", "--output-len", "3"])
    out = capsys.readouterr().out
    rows = {r.split("|")[1].strip(): r for r in out.splitlines() if r.startswith("| ")}
    assert {"gguf", "float", "int4"} <= set(rows) and "failed" not in out
    assert rows["float"].count("1.00x") == 2  # the float path is the reference of both ratios
    assert "Machine:" in out


def test_gguf_memory(tiny_gguf, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VX_CACHE_DIR", str(tmp_path / "cache"))
    share_kernels(tmp_path / "cache")
    get_main("gguf_memory")(["--model", tiny_gguf("Q8_0").gguf_path, "--runs", "1", "--max-model-len", "64",
                             "--max-tokens", "4"])
    out = capsys.readouterr().out
    assert "vx, GGUF natively" in out and "vx, expanded to float32" in out and "ratio (native / float)" in out


def test_latency(tiny_gguf, capsys):
    import importlib.util

    get_main("latency")(["--gguf", tiny_gguf("Q8_0").gguf_path, "--rounds", "1", "--prompt-tokens", "16",
                         "--decode-tokens", "4", "--decode-prompt-tokens", "4", "--hf-dtypes", "float32"])
    out = capsys.readouterr().out
    rows = {r.split("|")[1].strip(): r for r in out.splitlines() if r.startswith("| ")}
    assert {"vx", "hf-float32"} <= set(rows) and "failed" not in out
    assert "Q8_0 100% GGUF" in rows["vx"] and rows["vx"].count("1.00x") == 2  # vx is its own reference
    if importlib.util.find_spec("llama_cpp") is None:
        assert "llama.cpp skipped: llama-cpp-python is not installed" in out
    else:
        assert "llama.cpp" in rows
    assert "Machine:" in out and "TTFT 16 ms" in out


def test_batch_throughput(tiny_gguf, capsys):
    import importlib.util

    get_main("batch_throughput")(["--gguf", tiny_gguf("Q8_0").gguf_path, "--num-requests", "2,3", "--rounds", "1",
                                  "--prompt-tokens", "4", "--new-tokens", "3", "--hf-batch-sizes", "1,2,4",
                                  "--hf-probe-tokens", "2", "--threads", "1"])
    out = capsys.readouterr().out
    rows = [[c.strip() for c in r.split("|")[1:-1]] for r in out.splitlines() if r.startswith("| ") and "---" not in r]
    engines = {(r[0], r[1]) for r in rows[1:]}
    want = {"vx", "hf"} | ({"llama.cpp"} if importlib.util.find_spec("llama_cpp") else set())
    assert engines == {(n, e) for n in ("2", "3") for e in want} and "failed" not in out
    assert all(r[-1] == "1.00x" for r in rows[1:] if r[1] == "vx")  # vx is its own reference
    assert "HF batch size: the fastest in a probe" in out and "batches of " in out
    assert "above a bare torch process" in out and "Machine:" in out


def test_parallel(micro_model, capsys):
    get_main("parallel")(["--model", micro_model, "--layouts", "uni,2x1,1x2", "--num-requests", "2",
                          "--output-len", "3", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "| 2x1 " in out and "| 1x2 " in out and "comm share" in out


def test_a_child_killed_by_a_signal_says_so(monkeypatch):
    """A competitor that crashes in native code prints nothing: the table says which signal ended it."""
    import subprocess

    from benchmarks import common

    monkeypatch.setattr(common.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, -11, stdout="", stderr=""))
    assert common.run_child("benchmarks.latency", []) == "failed: killed by SIGSEGV"


def test_vs_llama_cpp(tmp_path, capsys):
    get_main("vs_llama_cpp")(["--shapes", "tiny", "--rounds", "1", "--decode-tokens", "2", "--prefill-tokens", "8",
                              "--concurrent", "2", "--concurrent-tokens", "2", "--context", "64", "--hf-dtype", "none",
                              "--llama-cpp-bin", str(tmp_path), "--bandwidth-gib", "0.01"])
    out = capsys.readouterr().out
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in out.splitlines()
            if r.startswith("| ") and "---" not in r}
    vx, vx_llm, llama_cpp, hf = rows["batch-1 decode, tok/s"][:4]
    assert float(vx) > 0 and float(vx_llm) > 0 and llama_cpp == "not built" and hf == "skipped (--hf-dtype none)"
    assert rows["2 requests x 2 tokens, tok/s"][2] == "not built"
    assert rows["weights a decode step reads, MiB"][2].endswith("(file)")
    assert "| tiny " in out and "Machine:" in out and "llama.cpp: not built: no llama-bench" in out
