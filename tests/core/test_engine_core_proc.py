"""EngineCoreProc in its own process, driven over its raw sockets: handshake, malformed input, idling,
engine faults, parent death, graceful shutdown."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time

import msgspec
import psutil
import pytest
import zmq
from tests.support.engine_processes import ENGINE_KWARGS, child_pids, cpu_seconds, kill_parent_expect_engine_gone, process_gone
from tests.support.faulty_executors import FailAfter2Steps, backend
from tests.support.hostile_models import truncate_weights

import vx
from vx.client.engine_process import EngineProcess
from vx.config import EngineArgs
from vx.core.protocol import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType as T, UtilityRequest

GREEDY = vx.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    ep = EngineProcess(EngineArgs(model=tiny_model_dir, **ENGINE_KWARGS).create_config())
    yield ep
    ep.close()


def recv(ep: EngineProcess, timeout: float = 10.0) -> EngineCoreOutputs:
    if not ep.output_socket.poll(timeout * 1000):
        raise AssertionError("no output from the engine")
    return ep.decoder.decode(ep.output_socket.recv())


def send_raw(ep: EngineProcess, frames: list[bytes]) -> None:
    with ep._send_lock:
        ep.input_socket.send_multipart(frames)


def run_to_end(ep: EngineProcess, request_id: str, max_tokens: int = 6) -> list[int]:
    params = GREEDY.clone(max_tokens=max_tokens)
    ep.send(T.ADD, EngineCoreRequest(request_id=request_id, prompt_token_ids=[5, 6, 7], sampling_params=params))
    tokens: list[int] = []
    while True:
        outs = recv(ep)
        for o in outs.outputs:
            assert o.request_id == request_id
            tokens += o.new_token_ids
            if o.finished:
                return tokens


def call(ep: EngineProcess, method: str, call_id: int = 1):
    ep.send(T.UTILITY, UtilityRequest(call_id=call_id, method=method))
    while True:
        outs = recv(ep)
        if outs.utility_output is not None and outs.utility_output.call_id == call_id:
            return outs.utility_output


def test_handshake_and_private_ipc_dir(engine):
    assert engine.ready.pid == engine.proc.pid and engine.ready.num_kv_blocks == ENGINE_KWARGS["num_kv_blocks"]
    assert stat.S_IMODE(os.stat(engine.ipc_dir).st_mode) == 0o700
    assert sorted(os.listdir(engine.ipc_dir)) == ["input", "output"]
    for sock, name in ((engine.input_socket, "input"), (engine.output_socket, "output")):
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        assert endpoint == f"ipc://{os.path.join(engine.ipc_dir, name)}"
        assert stat.S_ISSOCK(os.stat(os.path.join(engine.ipc_dir, name)).st_mode)
    # No TCP (or UDP) endpoint anywhere: not in the engine, not in the client's sockets.
    assert psutil.Process(engine.proc.pid).net_connections(kind="inet") == []
    assert not [c for c in psutil.Process().net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN]


def test_malformed_messages_get_error_outputs_and_engine_keeps_serving(engine):
    bad_params = msgspec.msgpack.encode(["bad-1", [1, 2], {"temperature": -1.0}])
    cases = [
        ([b"\x09", b""], None, "unknown input message type 9"),
        ([b"\x00"], None, "expected 2 frames"),
        ([b"\x00", b"\xc1\xc1"], None, "malformed ADD"),
        ([b"\x00", bad_params], "bad-1", "temperature must be >= 0"),
        ([b"\x01", msgspec.msgpack.encode("not-a-list")], None, "malformed ABORT"),
        ([b"\x02", msgspec.msgpack.encode({"x": 1})], None, "malformed UTILITY"),
    ]
    for frames, request_id, message in cases:
        send_raw(engine, frames)
        outs = recv(engine)
        assert len(outs.input_errors) == 1 and not outs.outputs
        assert outs.input_errors[0].request_id == request_id
        assert message in outs.input_errors[0].message
    assert "unknown utility method 'nope'" in call(engine, "nope").error
    assert len(run_to_end(engine, "good")) == 6  # still serving
    assert engine.proc.is_alive()


def test_values_outside_the_model_fail_alone(engine):
    """Values the front end refuses, sent straight to the engine: each request is refused alone, as the caller's
    fault, and the engine keeps serving. Before, top_k = 2**63 (a uint64 on the wire) ended the engine when it
    became a tensor, and an out-of-vocabulary id in logit_bias or stop_token_ids did when the logits were indexed."""
    max_len = ENGINE_KWARGS["max_model_len"]
    raw_top_k = msgspec.msgpack.encode(["huge-top-k", [5, 6], {"top_k": 2**63, "temperature": 1.0}])
    send_raw(engine, [b"\x00", raw_top_k])
    cases = [
        (dict(sampling_params=vx.SamplingParams(top_k=10**6, temperature=1.0)),
         "top_k=1000000 exceeds the model's vocabulary size (512)"),
        (dict(sampling_params=vx.SamplingParams(logit_bias={600: 1.0})), "logit_bias key 600"),
        (dict(sampling_params=vx.SamplingParams(stop_token_ids=[600], min_tokens=2)), "stop_token_ids entry 600"),
        (dict(prompt_token_ids=[5, 600]), "prompt token id 600 (position 1)"),
        (dict(bad_words_token_ids=[[5, 600]]), "bad_words token 600"),
        (dict(eos_token_ids=[0, 2**40]), f"eos token id {2**40}"),
        (dict(prompt_token_ids=[5] * max_len), f"The prompt is {max_len} tokens long"),
    ]
    for i, (fields, _) in enumerate(cases):
        engine.send(T.ADD, EngineCoreRequest(**{"request_id": f"bad-{i}", "prompt_token_ids": [5, 6],
                                                "sampling_params": GREEDY, **fields}))
    errors = {}
    while len(errors) < len(cases) + 1:
        outs = recv(engine)
        assert not outs.outputs and outs.engine_error is None
        errors.update((e.request_id, e) for e in outs.input_errors)
    assert "top_k must be <= 9223372036854775807" in errors["huge-top-k"].message
    for i, (_, message) in enumerate(cases):
        assert message in errors[f"bad-{i}"].message
    assert not any(e.internal for e in errors.values())
    assert len(run_to_end(engine, "good")) == 6 and engine.proc.is_alive()


def test_refused_request_fails_alone_and_abort_frees_blocks(engine):
    long = EngineCoreRequest(request_id="dup", prompt_token_ids=list(range(1, 40)),
                             sampling_params=GREEDY.clone(max_tokens=200))
    engine.send(T.ADD, long)
    engine.send(T.ADD, long)
    refused = None
    while refused is None:
        outs = recv(engine)
        refused = next((e for e in outs.input_errors), None)
    assert refused.request_id == "dup" and "already running" in refused.message
    stats = call(engine, "stats", call_id=2).result
    assert stats["num_running"] == 1 and stats["kv_blocks_in_use"] > 0
    engine.send(T.ABORT, ["dup", "unknown-id"])
    stats = call(engine, "stats", call_id=3).result
    assert (stats["num_running"], stats["num_waiting"], stats["kv_blocks_in_use"]) == (0, 0, 0)
    while engine.output_socket.poll(100):  # drop the outputs of steps before the abort
        engine.output_socket.recv()


def test_duplicate_live_id_leaves_the_live_request_alone(engine):
    expected = run_to_end(engine, "solo", max_tokens=12)
    live = EngineCoreRequest(request_id="twice", prompt_token_ids=[5, 6, 7],
                             sampling_params=GREEDY.clone(max_tokens=12))
    intruder = EngineCoreRequest(request_id="twice", prompt_token_ids=[9, 9, 9, 9],
                                 sampling_params=GREEDY.clone(max_tokens=3))
    engine.send(T.ADD, live)
    engine.send(T.ADD, intruder)
    tokens: list[int] = []
    errors = []
    finished = False
    while not finished:
        outs = recv(engine)
        errors += outs.input_errors
        for o in outs.outputs:
            tokens += o.new_token_ids
            finished = o.finished
    assert [(e.request_id, "already running" in e.message) for e in errors] == [("twice", True)]
    assert tokens == expected  # the live request ran as if the intruder had never come
    assert len(run_to_end(engine, "twice", max_tokens=3)) == 3  # once finished, the id may be used again


def test_idle_engine_sleeps(engine):
    time.sleep(0.3)
    before = cpu_seconds(engine.proc.pid)
    time.sleep(2.0)
    used = cpu_seconds(engine.proc.pid) - before
    assert used < 0.05 * 2.0, f"idle engine used {used:.3f} s of CPU in 2 s"


def test_ctrl_c_belongs_to_the_application(engine):
    """Ctrl-C reaches the whole foreground process group: the engine ignores it and keeps serving."""
    os.kill(engine.proc.pid, signal.SIGINT)
    time.sleep(0.2)
    assert engine.proc.is_alive() and len(run_to_end(engine, "after-ctrl-c", max_tokens=3)) == 3


def test_graceful_shutdown_cleans_up(engine, caplog):
    """Keep last in the module: stops the shared engine."""
    caplog.set_level(logging.WARNING)
    pid, ipc_dir = engine.proc.pid, engine.ipc_dir
    engine.close()
    assert engine.exitcode == 0
    assert not os.path.exists(ipc_dir) and process_gone(pid)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    with pytest.raises(vx.EngineDeadError, match="shut down"):
        engine.raise_if_dead()


def test_engine_fault_reaches_the_client_with_its_message(tiny_model_dir):
    before = child_pids()
    llm = vx.LLM(tiny_model_dir, multiprocess=True, distributed_executor_backend=backend(FailAfter2Steps),
                 **ENGINE_KWARGS)
    try:
        with pytest.raises(vx.EngineDeadError, match="injected failure after 2 model steps") as info:
            llm.generate(["a", "b"], GREEDY, use_tqdm=False)
        assert "Traceback" in str(info.value.__cause__)
        t0 = time.monotonic()
        with pytest.raises(vx.EngineDeadError, match="injected failure"):
            llm.generate("again", GREEDY, use_tqdm=False)
        with pytest.raises(vx.EngineDeadError):
            llm.stats()
        assert time.monotonic() - t0 < 0.5
    finally:
        llm.shutdown()
    assert child_pids() <= before


_PARENT = textwrap.dedent("""
    import sys, tempfile, threading, time
    import psutil
    from vx.client.engine_process import EngineProcess
    from vx.config import EngineArgs

    tempfile.tempdir = sys.argv[2]  # the ipc dir goes where the test can look for it
    config = EngineArgs(model=sys.argv[1], dtype="float32", device="cpu", num_kv_blocks=64,
                        max_model_len=128).create_config(light=True)
    holder = []  # keeps the EngineProcess alive: dropping it would stop the engine
    threading.Thread(target=lambda: holder.append(EngineProcess(config)), daemon=True).start()
    me = psutil.Process()
    while True:  # wait until the engine runs its own code (its parent watchdog is its first thread)
        engines = [c for c in me.children() if "resource_tracker" not in " ".join(c.cmdline())]
        if engines and engines[0].num_threads() >= 2:
            break
        time.sleep(0.05)
    print(engines[0].pid, flush=True)
    time.sleep(600)
""")


def test_engine_exits_when_its_parent_dies(tiny_model_dir, tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, tiny_model_dir, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    kill_parent_expect_engine_gone(parent, str(tmp_path))


def test_start_up_failure_comes_back_through_the_handshake(tiny_model_dir, tmp_path, monkeypatch):
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    truncate_weights(str(broken / "model.safetensors"))
    config = EngineArgs(model=str(broken), **ENGINE_KWARGS).create_config()  # fine here: only the engine finds out
    ipc_root = tmp_path / "ipc"
    ipc_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(ipc_root))  # where the engine's ipc dir is made
    before = child_pids()
    with pytest.raises(vx.EngineDeadError, match="failed to start") as info:
        EngineProcess(config)
    assert "Traceback" in str(info.value.__cause__)
    assert child_pids() <= before
    assert os.listdir(ipc_root) == []
