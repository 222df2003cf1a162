"""The `vx` command: generate, chat (Ctrl-C stops a reply, not the session), bench."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

VX = [sys.executable, "-m", "vx.cli"]
ENV = dict(os.environ, TOKENIZERS_PARALLELISM="false")


def test_generate_streams_a_completion(tiny_model_dir):
    res = subprocess.run(VX + ["generate", "hello world", "--model", tiny_model_dir, "--max-tokens", "6",
                               "--temperature", "0"], capture_output=True, text=True, env=ENV, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip()


def test_bad_engine_arg_is_a_clear_error(tiny_model_dir):
    res = subprocess.run(VX + ["generate", "hi", "--model", tiny_model_dir, "--block-size", "3"],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert res.returncode != 0 and "block_size" in res.stderr and "Traceback" not in res.stderr


def test_bench_lists_the_benchmarks():
    res = subprocess.run(VX + ["bench", "help"], capture_output=True, text=True, env=ENV, timeout=120)
    assert res.returncode == 0 and "throughput" in res.stdout and "common" not in res.stdout


@pytest.mark.slow
def test_chat_answers_and_ctrl_c_stops_only_the_reply(default_model_dir):
    proc = subprocess.Popen(VX + ["chat", "--temperature", "0", "--max-tokens", "400"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, bufsize=1)
    try:
        proc.stdin.write("Write a very long story about a dragon.\n")
        proc.stdin.flush()
        first = proc.stdout.read(1)  # the reply has started streaming
        assert first
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        # The next message, then end of input (Ctrl-D): the session ends after this reply.
        out, err = proc.communicate("What is the capital of France?\n", timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert "[stopped]" in out
    assert "Paris" in out.split("[stopped]", 1)[1]
