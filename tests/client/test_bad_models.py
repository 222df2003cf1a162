"""A model that is missing, not a model, corrupted, of an unsupported architecture or hostile (a config or GGUF
header claiming what no model has) gets a clear error that says what is wrong (and where), from `vx.LLM` and from
`vx.AsyncLLM`; nothing is left running, and a hostile file is refused fast, in bounded memory."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tests.support.kernel_cache import share_kernels
from tests.support.engine_processes import ENGINE_KWARGS, child_pids

import vx
from vx.models.registry import supported_architectures

SUPPORTED = tuple(supported_architectures())


def broken_copy(tiny_model_dir: str, tmp_path, damage: str) -> str:
    """A copy of the tiny model with one thing broken."""
    dst = str(tmp_path / f"model-{damage}")
    shutil.copytree(tiny_model_dir, dst)
    if damage == "garbage-weights":
        with open(os.path.join(dst, "model.safetensors"), "wb") as f:
            f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header at all" + os.urandom(256))
    elif damage == "truncated-weights":
        path = os.path.join(dst, "model.safetensors")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    elif damage == "no-weights":
        os.remove(os.path.join(dst, "model.safetensors"))
    elif damage == "gpt2":
        path = os.path.join(dst, "config.json")
        with open(path) as f:
            config = json.load(f)
        config["architectures"] = ["GPT2LMHeadModel"]
        with open(path, "w") as f:
            json.dump(config, f)
    elif damage == "config-not-json":
        with open(os.path.join(dst, "config.json"), "w") as f:
            f.write("{ this is not json")
    elif damage == "config-nested-deep":
        with open(os.path.join(dst, "config.json"), "w") as f:
            f.write('{"a": ' + "[" * 100_000)
    else:
        raise ValueError(damage)
    return dst


@pytest.mark.parametrize("where, message", [
    ("missing", "does not exist"),
    ("file", "not a .gguf model"),
    ("folder", "not a model directory"),
])
def test_model_path_that_is_not_a_model(tiny_model_dir, tmp_path, where, message):
    path = {"missing": str(tmp_path / "no-such-model"),
            "file": os.path.join(tiny_model_dir, "config.json"),
            "folder": str(tmp_path)}[where]
    with pytest.raises(ValueError, match=message):
        vx.LLM(path, **ENGINE_KWARGS)
    with pytest.raises(ValueError, match=message):
        vx.AsyncLLM(path, **ENGINE_KWARGS)  # refused by the constructor, before any engine starts


def test_unknown_engine_argument_lists_the_known_ones(tiny_model_dir):
    for make in (vx.LLM, vx.AsyncLLM):
        with pytest.raises(ValueError, match="Unknown engine argument.*max_num_sequences.*Known:.*max_num_seqs"):
            make(tiny_model_dir, max_num_sequences=4)


@pytest.mark.parametrize("damage, message", [
    ("garbage-weights", r"Cannot read weights file .*model\.safetensors"),
    ("truncated-weights", r"model\.safetensors"),
    ("no-weights", r"No \*\.safetensors weights"),
    ("gpt2", "'GPT2LMHeadModel' is not supported. Supported: " + ", ".join(SUPPORTED)),
    ("config-not-json", "Could not read the model config"),
    ("config-nested-deep", "Could not read the model config"),
])
def test_broken_model_in_process(tiny_model_dir, tmp_path, damage, message):
    path = broken_copy(tiny_model_dir, tmp_path, damage)
    with pytest.raises(ValueError, match=message):
        vx.LLM(path, **ENGINE_KWARGS)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.anyio
async def test_unsupported_architecture_is_refused_before_an_engine_starts(anyio_backend, tiny_model_dir, tmp_path):
    """Starting reads config.json's architectures and refuses an unknown one with the supported list, before any
    engine process exists."""
    path = broken_copy(tiny_model_dir, tmp_path, "gpt2")
    before = child_pids()
    llm = vx.AsyncLLM(path, **ENGINE_KWARGS)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*Supported: " + ", ".join(SUPPORTED)):
        async with llm:
            pass
    assert child_pids() <= before


# ------------------------------------------------------------------------------------------ quantized checkpoints
def _awq_checkpoint(tiny_model_dir: str, tmp_path, **config) -> str:
    from tests.support.quantized_checkpoints import awq, quantized_pair

    quant_dir, _ = quantized_pair(tiny_model_dir, tmp_path, awq(32), {
        "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm", **config})
    return quant_dir


@pytest.mark.parametrize("multiprocess", [False, True])
def test_a_quantized_checkpoint_vx_cannot_read_is_refused_at_load(tiny_model_dir, tmp_path, multiprocess):
    """The front end knows the method (awq) but not its variant (3-bit): the engine refuses as it loads, and
    nothing of it is left."""
    path = _awq_checkpoint(tiny_model_dir, tmp_path, bits=3)
    before = child_pids()
    error = vx.EngineDeadError if multiprocess else ValueError
    with pytest.raises(error, match="AWQ with 3-bit weights is not supported"):
        vx.LLM(path, multiprocess=multiprocess, **ENGINE_KWARGS)
    assert child_pids() <= before


@pytest.mark.parametrize("checkpoint, configured, message", [
    ({"quant_method": "bitnet", "bits": 1}, None,
     "quantized with quant_method='bitnet', but the engine was configured to load it with quantization=None"),
    (None, "gptq", "quantized with quant_method='awq', but the engine was configured to load it with "
                   "quantization='gptq'"),
])
@pytest.mark.parametrize("multiprocess", [False, True])
def test_the_engine_refuses_a_config_made_elsewhere_that_disagrees_with_the_checkpoint(
        tiny_model_dir, tmp_path, checkpoint, configured, message, multiprocess):
    """EngineArgs resolves the method from the checkpoint; a VxConfig made otherwise can disagree with it, and the
    engine then refuses at load instead of reading quantized tensors some other way."""
    import msgspec

    from vx.client.llm_engine import LLMEngine
    from vx.config import EngineArgs, QuantConfig

    path = _awq_checkpoint(tiny_model_dir, tmp_path)
    config = EngineArgs(model=path, **ENGINE_KWARGS).create_config()
    if checkpoint is not None:
        config.model_config.hf_config.quantization_config = checkpoint
    config = msgspec.structs.replace(config, quant_config=QuantConfig(method=configured))
    before = child_pids()
    error = vx.EngineDeadError if multiprocess else ValueError
    with pytest.raises(error, match=message):
        LLMEngine(config, multiprocess=multiprocess)
    assert child_pids() <= before


# ------------------------------------------------------------------------------------------ hostile model files
# Each file's refusal, which names the field (or key) and its value.
HOSTILE = {
    "huge-layer-count": (dict(num_hidden_layers=10**9), r"num_hidden_layers=1000000000 is out of range"),
    "nan-eps": (dict(rms_norm_eps=math.nan), r"rms_norm_eps=nan is not a finite number"),
    "zero-heads": (dict(num_attention_heads=0), r"num_attention_heads=0 is out of range"),
    "zero-vocab": (dict(vocab_size=0), r"vocab_size=0 is out of range"),
    "negative-hidden": (dict(hidden_size=-64), r"hidden_size=-64 is out of range"),
    "gguf-string-bomb": (None, r"GGUF file .*bomb\.gguf' is refused: an array of 5000000 items at key "
                               r"'tokenizer\.ggml\.tokens' is over vx's limit of 1048576 "
                               r"\(GGUFLimits\.max_array_items\)"),
    "gguf-huge-layer-count": (None, r"GGUF file .*layers\.gguf': llama\.block_count=1000000000 is out of range"),
}


@pytest.fixture(scope="module")
def hostile_models(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    """name -> path of each hostile file: the tiny model with one config.json field set to it, a GGUF file of 5M
    empty vocabulary strings (40 MB), a small GGUF file that states 10**9 layers."""
    from tests.support.hostile_models import with_config, write_small_gguf, write_string_bomb

    folder = tmp_path_factory.mktemp("hostile")
    paths = {name: with_config(tiny_model_dir, folder / name, **change)
             for name, (change, _) in HOSTILE.items() if change is not None}
    paths["gguf-string-bomb"] = write_string_bomb(folder / "bomb.gguf")
    paths["gguf-huge-layer-count"] = write_small_gguf(folder / "layers.gguf", layers_stated=10**9)
    return paths


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_model_file_is_refused_naming_what_is_wrong(hostile_models, name, tmp_path, monkeypatch):
    monkeypatch.setenv("VX_CACHE_DIR", str(tmp_path))  # where a GGUF file's config directory would go
    share_kernels(tmp_path)
    with pytest.raises(ValueError, match=HOSTILE[name][1]):
        vx.LLM(hostile_models[name], **ENGINE_KWARGS)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.parametrize("name", list(HOSTILE))
@pytest.mark.anyio
async def test_async_llm_refuses_a_hostile_model_file_as_it_starts(anyio_backend, hostile_models, name, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setenv("VX_CACHE_DIR", str(tmp_path))
    share_kernels(tmp_path)
    before = child_pids()
    llm = vx.AsyncLLM(hostile_models[name], **ENGINE_KWARGS)
    with pytest.raises(ValueError, match=HOSTILE[name][1]):
        async with llm:
            pass
    assert child_pids() <= before


def test_why_the_gguf_config_child_failed_reaches_the_value_error(tmp_path, monkeypatch):
    """A file that passes the header checks but that the child writing its config directory refuses: the child's
    reason is the ValueError's message (it was "printed above", or nothing when the child was killed)."""
    from tests.support.hostile_models import write_small_gguf

    monkeypatch.setenv("VX_CACHE_DIR", str(tmp_path / "cache"))
    share_kernels(tmp_path / "cache")
    path = write_small_gguf(tmp_path / "falcon.gguf", arch="falcon")
    with pytest.raises(ValueError, match=r"Could not read the config of GGUF file .*falcon\.gguf': GGUF architecture "
                                         r"'falcon' is not supported; supported: llama"):
        vx.LLM(path, **ENGINE_KWARGS)


@pytest.mark.parametrize("returncode, stderr, reason", [
    (1, b"warning: x\nerror: the reason\n", "the reason"),
    (-9, b"", "it was killed by SIGKILL (out of memory?), with no message"),
    (1, b"Traceback ...\nMemoryError\n", "exit code 1; it printed: Traceback ...\nMemoryError"),
])
def test_a_child_that_dies_without_an_error_line_is_described(returncode, stderr, reason):
    from vx.config.model_source import _child_failure

    assert _child_failure(subprocess.CompletedProcess([], returncode, stderr=stderr)) == reason


# Loads each hostile file in a fresh process and reports, per file, how it failed, how long it took and how far it
# raised the process's peak RSS. The first load (not reported) imports what any load imports. An address-space
# limit well above what the process holds makes a regression fail with MemoryError instead of taking the
# machine's memory (torch reserves far more address space than it uses, so the limit is relative to that).
_PROBE = textwrap.dedent("""
    import json, resource, sys, time
    import vx

    def peak_rss():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    def address_space():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))

    def load(path):
        start = time.monotonic()
        try:
            vx.LLM(path, **kwargs)
            outcome = "no error"
        except ValueError as e:
            outcome = f"ValueError: {e}"
        except BaseException as e:
            outcome = f"{type(e).__name__}: {e}"
        return outcome, time.monotonic() - start

    kwargs, paths = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    load(paths["nan-eps"])
    resource.setrlimit(resource.RLIMIT_AS, (address_space() + 2 * 2**30, resource.getrlimit(resource.RLIMIT_AS)[1]))
    results = {}
    for name, path in paths.items():
        before = peak_rss()
        outcome, seconds = load(path)
        results[name] = dict(outcome=outcome, seconds=seconds, rss_growth=peak_rss() - before)
    print(json.dumps(results))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and ru_maxrss as Linux has them")
def test_hostile_model_files_fail_fast_with_bounded_memory(hostile_models, tmp_path):
    """Each hostile file is refused in under 5 s, growing the process by under 500 MB (the probes that found them
    saw over 6 GB after 70-80 s, or a model answering token 0)."""
    share_kernels(tmp_path)
    env = {**os.environ, "VX_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(ENGINE_KWARGS), json.dumps(hostile_models)],
                         capture_output=True, text=True, env=env, timeout=180, cwd=str(Path(__file__).parents[2]))
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.splitlines()[-1])
    assert set(results) == set(HOSTILE)
    for name, result in results.items():
        assert result["outcome"].startswith("ValueError: "), (name, result)
        assert re.search(HOSTILE[name][1], result["outcome"]), (name, result)
        assert result["seconds"] < 5 and result["rss_growth"] < 500 * 2**20, (name, result)
