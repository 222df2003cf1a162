"""The `vx` command: generate, chat (Ctrl-C stops a reply, not the session), bench, and serve's flags (the
server itself is tested in tests/serve)."""

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


def test_serve_flags_fill_the_server_options():
    from vx.cli import build_parser, server_options
    from vx.serve.options import ServerOptions

    ns = build_parser().parse_args(["serve", "--max-body-bytes", "1000", "--header-timeout", "2.5",
                                    "--keep-alive-on-engine-death"])
    assert server_options(ns) == ServerOptions(max_body_bytes=1000, header_timeout=2.5, keep_alive_on_engine_death=True)
    assert server_options(build_parser().parse_args(["serve"])) == ServerOptions()


def test_serve_api_key_sources(tmp_path, monkeypatch, caplog):
    from vx.cli import _api_key, build_parser

    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    parse = build_parser().parse_args
    monkeypatch.setenv("VX_API_KEY", "sk-from-env")
    assert _api_key(parse(["serve", "--api-key-file", str(key_file)])) == "sk-from-file"
    assert _api_key(parse(["serve"])) == "sk-from-env"
    assert _api_key(parse(["serve", "--api-key", "sk-flag"])) == "sk-flag"
    assert "process list" in caplog.text  # a key on the command line is visible to every user
    monkeypatch.delenv("VX_API_KEY")
    assert _api_key(parse(["serve"])) is None
    for args in (["--api-key", "a", "--api-key-file", str(key_file)], ["--api-key-file", str(tmp_path / "no")]):
        with pytest.raises(ValueError, match="api-key"):
            _api_key(parse(["serve", *args]))


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                            ("0.0.0.0", False), ("::", False), ("example.com", False)])
def test_only_loopback_hosts_pass_without_a_warning(host, loopback):
    from vx.cli import _is_loopback

    assert _is_loopback(host) is loopback


def test_serve_refuses_a_bad_limit_clearly(tiny_model_dir):
    res = subprocess.run(VX + ["serve", "--model", tiny_model_dir, "--max-body-bytes", "0"], capture_output=True,
                         text=True, env=ENV, timeout=120)
    assert res.returncode != 0 and "max_body_bytes" in res.stderr and "Traceback" not in res.stderr
