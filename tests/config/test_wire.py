"""vx/config/wire.py: the config crossing whole to the engine process, and what the engine process does with it
without importing transformers."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from typing import Any

import msgspec
import msgspec.inspect

from tests.support.kernel_cache import share_kernels
from vx.config import EngineArgs, VxConfig, decode_config, encode_config
from vx.config.hf_config import HFConfig, config_fields


def _changed(value: Any, t: msgspec.inspect.Type, path: str) -> Any:
    """A value of type `t` that differs from `value` (a whole new Struct for a Struct type, field by field)."""
    if isinstance(t, msgspec.inspect.StructType):
        return t.cls(**{f.name: _changed(getattr(value, f.name), f.type, f"{path}.{f.name}")
                        for f in t.fields})
    if isinstance(t, msgspec.inspect.UnionType):
        (inner,) = [u for u in t.types if not isinstance(u, msgspec.inspect.NoneType)]
        return _changed(value, inner, path) if value is not None else _an_example(inner, path)
    if isinstance(t, msgspec.inspect.BoolType):
        return not value
    if isinstance(t, msgspec.inspect.IntType):
        return value + 3
    if isinstance(t, msgspec.inspect.FloatType):
        return value + 0.25
    if isinstance(t, msgspec.inspect.StrType):
        return value + "-changed"
    if isinstance(t, msgspec.inspect.ListType):
        return [*value, _an_example(t.item_type, path)]
    if path == "config.model_config.hf_config":  # typed Any: the model's transformers config, one value changed
        changed = copy.deepcopy(value)
        changed.rms_norm_eps = 0.125
        return changed
    raise AssertionError(f"{path}: no changed value for a {t}; teach this test the new field's type")


def _an_example(t: msgspec.inspect.Type, path: str) -> Any:
    examples = {msgspec.inspect.IntType: 17, msgspec.inspect.FloatType: 0.75, msgspec.inspect.StrType: "x"}
    if type(t) not in examples:
        raise AssertionError(f"{path}: no example of a {t}; teach this test the new field's type")
    return examples[type(t)]


def _leaves(value: Any, path: str = "config") -> dict[str, Any]:
    if isinstance(value, msgspec.Struct):
        return {k: v for f in msgspec.structs.fields(value) for k, v in _leaves(getattr(value, f.name),
                                                                                  f"{path}.{f.name}").items()}
    return {path: value}


def test_every_config_field_reaches_the_engine_process_as_sent(tiny_model_dir):
    """The engine process gets the front end's `VxConfig` whole (`encode_config` in its startup message, `decode_config`
    in `run_engine_core_proc`): every field of every part, each set here to a value that is not the default (the
    fields are read from the Structs, so a new one is covered as soon as it exists), comes back equal."""
    config = EngineArgs(model=tiny_model_dir, device="cpu").create_config()
    sent = _changed(config, msgspec.inspect.type_info(VxConfig), "config")
    before, after = _leaves(config), _leaves(sent)
    assert before.keys() == after.keys()
    assert [k for k in before if before[k] == after[k]] == []  # every field differs from what create_config made
    received = decode_config(encode_config(sent))
    # The HF config arrives as its fields (an HFConfig, no transformers in the engine process), every one as sent.
    hf_sent = config_fields(sent.model_config.hf_config)
    assert isinstance(received.model_config.hf_config, HFConfig) and received.model_config.hf_config == hf_sent
    assert received.model_config.hf_config.rms_norm_eps == 0.125
    assert _leaves(received) == {**after, "config.model_config.hf_config": hf_sent}


def test_the_engine_process_runs_the_model_without_importing_transformers(tiny_model_dirs, tmp_path, monkeypatch):
    """What the engine process does with the config a light front end (AsyncLLM) sends: decode it, build the engine
    core (model loaded), run a request to its end. Once the config's resolution is cached, none of it imports
    transformers (~80 MiB of the engine's memory)."""
    config = EngineArgs(model=tiny_model_dirs["qwen3"], device="cpu", dtype="float32", num_kv_blocks=32,
                        max_model_len=128).create_config(light=True)
    (tmp_path / "config.bin").write_bytes(encode_config(config))
    monkeypatch.setenv("VX_CACHE_DIR", str(tmp_path))
    share_kernels(tmp_path)
    decode_config(encode_config(config))  # a first engine's start: resolves through transformers, caches
    code = """if True:
        import sys
        from vx.config import decode_config
        from vx.core.engine_core import EngineCore
        from vx.core.protocol import EngineCoreRequest
        from vx.sampling_params import SamplingParams
        core = EngineCore(decode_config(open(sys.argv[1], "rb").read()))
        core.add_request(EngineCoreRequest(request_id="r", prompt_token_ids=[3, 4, 5],
                                           sampling_params=SamplingParams(max_tokens=3, temperature=0.0)))
        tokens = []
        while core.has_unfinished_requests():
            tokens += [t for o in core.step().outputs for t in o.new_token_ids]
        core.shutdown()
        print(len(tokens), "transformers" in sys.modules)
    """
    env = {**os.environ, "VX_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "config.bin")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.stdout.split() == ["3", "False"], run.stderr[-2000:]
