"""vx/config.py: the model facts read from a Hugging Face config and model-directory JSON files; the
request-isolation limits (max_n_sequences, grammar compile limits), validated and landing in one config place each;
the config crossing whole to the engine process."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import msgspec
import msgspec.inspect
import pytest

from vx.config import (EngineArgs, ModelConfig, VxConfig, decode_config, encode_config, hf_head_dim, hf_num_kv_heads,
                       read_json)
from vx.cpu_defaults import (default_cpu_max_num_batched_tokens, default_cpu_max_num_seqs,
                             default_grammar_compile_workers)
from vx.hf_config import HFConfig, config_fields, resolve_hf_config


@pytest.mark.parametrize("fields,kv_heads,head_dim", [
    (dict(num_attention_heads=8, hidden_size=512), 8, 64),                               # no GQA
    (dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=512), 2, 64),       # GQA
    (dict(num_attention_heads=16, num_key_value_heads=8, hidden_size=1024, head_dim=128), 8, 128),  # Qwen3
    (dict(num_attention_heads=8, num_key_value_heads=None, hidden_size=512, head_dim=None), 8, 64),
])
def test_head_rules(fields, kv_heads, head_dim):
    hf = SimpleNamespace(**fields)
    assert (hf_num_kv_heads(hf), hf_head_dim(hf)) == (kv_heads, head_dim)
    mc = ModelConfig(model="m", tokenizer="m", hf_config=hf, architecture="LlamaForCausalLM", dtype="float32",
                     max_model_len=16, vocab_size=10, eos_token_ids=[])
    assert (mc.num_kv_heads, mc.head_dim) == (kv_heads, head_dim)


def test_read_json(tmp_path):
    (tmp_path / "ok.json").write_text('{"a": 1}', encoding="utf-8")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bad.json").write_text("{")
    assert read_json(str(tmp_path / "ok.json")) == {"a": 1}
    for name in ("list.json", "bad.json", "missing.json"):
        assert read_json(str(tmp_path / name)) == {}


@pytest.mark.parametrize("name, value", [
    ("max_n_sequences", 0), ("max_n_sequences", 1.5), ("max_n_sequences", True), ("max_n_sequences", 2**63),
    ("grammar_cache_memory_bytes", 0), ("grammar_cache_memory_bytes", None),
    ("max_grammar_memory_bytes", -1), ("max_grammar_memory_bytes", "1"),
    ("grammar_compile_timeout_s", 0), ("grammar_compile_timeout_s", -1.0), ("grammar_compile_timeout_s", float("nan")),
    ("grammar_compile_timeout_s", float("inf")), ("grammar_compile_timeout_s", True),
    ("grammar_compile_timeout_s", None),
    ("grammar_compile_workers", 0), ("grammar_compile_workers", 1.0),
])
def test_bad_limits_are_refused_with_their_name(tiny_model_dir, name, value):
    with pytest.raises(ValueError, match=name):
        EngineArgs(model=tiny_model_dir, **{name: value}).validate()


def test_limits_reach_the_config(tiny_model_dir):
    config = EngineArgs(model=tiny_model_dir, device="cpu", max_n_sequences=3, grammar_cache_memory_bytes=1000,
                        max_grammar_memory_bytes=100, grammar_compile_timeout_s=2,
                        grammar_compile_workers=5).create_config(light=True)
    assert config.scheduler_config.max_n_sequences == 3
    so = config.structured_outputs_config
    assert (so.cache_memory_bytes, so.max_grammar_memory_bytes, so.compile_timeout_s, so.compile_workers) == \
        (1000, 100, 2.0, 5)


def test_defaults(tiny_model_dir):
    config = EngineArgs(model=tiny_model_dir, device="cpu").create_config(light=True)
    so = config.structured_outputs_config
    assert config.scheduler_config.max_n_sequences == 128
    assert (so.cache_memory_bytes, so.max_grammar_memory_bytes, so.compile_timeout_s) == (256 * 2**20, 64 * 2**20,
                                                                                          10.0)
    # At least two compiles run at once, so that one slow compile never holds up the others.
    assert so.compile_workers == default_grammar_compile_workers() >= 2


@pytest.mark.parametrize("cores, seqs, tokens", [(1, 32, 256), (2, 64, 512), (4, 128, 1024), (16, 256, 4096),
                                                 (64, 256, 8192)])
def test_cpu_scheduler_defaults_scale_with_the_cores(tiny_model_dir, monkeypatch, cores, seqs, tokens):
    from vx import platform

    monkeypatch.setattr(platform, "cpu_threads", lambda: cores)
    monkeypatch.setattr(platform, "cpu_flags", lambda: ("avx2", "fma"))
    config = EngineArgs(model=tiny_model_dir, device="cpu").create_config(light=True)
    assert config.device_config.cpu_threads == cores
    sc = config.scheduler_config
    assert (sc.max_num_seqs, sc.max_num_batched_tokens) == (seqs, tokens)
    assert (default_cpu_max_num_seqs(cores), default_cpu_max_num_batched_tokens(cores)) == (seqs, tokens)
    explicit = EngineArgs(model=tiny_model_dir, device="cpu", max_num_seqs=5,
                          max_num_batched_tokens=70).create_config(light=True).scheduler_config
    assert (explicit.max_num_seqs, explicit.max_num_batched_tokens) == (5, 70)
    # AMX tiles keep larger batches faster: twice the sequences a core, the same cap.
    monkeypatch.setattr(platform, "cpu_flags", lambda: ("avx512f", "amx_tile", "amx_bf16"))
    amx = EngineArgs(model=tiny_model_dir, device="cpu").create_config(light=True).scheduler_config
    assert amx.max_num_seqs == default_cpu_max_num_seqs(cores, amx=True) == min(256, 2 * seqs)


def test_cpu_threads_default_to_the_available_cores(tiny_model_dir, monkeypatch):
    from vx import platform

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    config = EngineArgs(model=tiny_model_dir, device="cpu").create_config(light=True)
    assert config.device_config.cpu_threads == platform.available_cpu_cores()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = EngineArgs(model=tiny_model_dir, device="cpu").create_config(light=True)
    amx = "amx_bf16" in platform.cpu_flags()
    assert config.device_config.cpu_threads == 1 and config.scheduler_config.max_num_seqs == (64 if amx else 32)


# ------------------------------------------------------------------------------- the config the engine receives
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


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
def test_the_front_ends_light_config_is_what_the_engine_would_resolve(tiny_model_dirs, family):
    """`AsyncLLM` resolves the config from config.json as plain JSON (no transformers, no torch); the engine uses
    it as sent, so it must be the config that the full resolution (through transformers) gives."""
    args = EngineArgs(model=tiny_model_dirs[family], device="cpu", max_num_seqs=3)
    full = args.create_config()
    received = decode_config(encode_config(args.create_config(light=True)))
    # Every field but the config's own path and the (classification) label maps, whose int keys JSON makes strings.
    def fields(hf):
        return {k: v for k, v in config_fields(hf).items() if k not in ("_name_or_path", "id2label", "label2id")}

    assert fields(received.model_config.hf_config) == fields(full.model_config.hf_config)
    # Every name the transformers config answers, its aliases too (Qwen3-MoE's and Mixtral's num_experts is stored
    # as num_local_experts): the MoE models read them (an engine process or a worker failed on it).
    for alias in type(full.model_config.hf_config).attribute_map:
        assert getattr(received.model_config.hf_config, alias) == getattr(full.model_config.hf_config, alias)
    def without_hf(config):
        return msgspec.structs.replace(config, model_config=msgspec.structs.replace(config.model_config,
                                                                                    hf_config=None))

    assert without_hf(received) == without_hf(full)


def test_a_config_is_resolved_through_transformers_once_then_from_the_cache(tmp_path, monkeypatch):
    """The engine process fills in the model type's defaults (here Qwen3's head_dim 128, Mistral's sliding window
    4096, neither in config.json) as transformers does, and keeps the result: a second engine with the same fields
    reads the cache file and does not import transformers. Other fields or another model type miss the cache."""
    monkeypatch.setenv("VX_CACHE_DIR", str(tmp_path))
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    qwen3 = resolve_hf_config(dict(base, model_type="qwen3"), "m")
    mistral = resolve_hf_config(dict(base, model_type="mistral"), "m")
    assert (qwen3.head_dim, hf_head_dim(qwen3), qwen3.sliding_window) == (128, 128, None)
    assert (mistral.sliding_window, hf_head_dim(mistral), mistral.rms_norm_eps) == (4096, 16, 1e-6)
    assert len(list((tmp_path / "hf-config").iterdir())) == 2

    code = ("import sys, json; from vx.hf_config import resolve_hf_config; "
            f"c = resolve_hf_config(json.loads({json.dumps(json.dumps(dict(base, model_type='qwen3')))}), 'm'); "
            "print(c.head_dim, 'transformers' in sys.modules)")
    env = {**os.environ, "VX_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["128", "False"]
    with pytest.raises(ValueError, match="unknown model_type 'nonsense'"):
        resolve_hf_config(dict(base, model_type="nonsense"), "m")
    # A config sent to the engine without EngineArgs' checks: refused before transformers builds 10**9 layer types.
    with pytest.raises(ValueError, match="num_hidden_layers=1000000000 is out of range"):
        resolve_hf_config(dict(base, model_type="qwen3", num_hidden_layers=10**9), "m")


def test_the_engine_process_runs_the_model_without_importing_transformers(tiny_model_dirs, tmp_path, monkeypatch):
    """What the engine process does with the config a light front end (AsyncLLM) sends: decode it, build the engine
    core (model loaded), run a request to its end. Once the config's resolution is cached, none of it imports
    transformers (~80 MiB of the engine's memory)."""
    config = EngineArgs(model=tiny_model_dirs["qwen3"], device="cpu", dtype="float32", num_kv_blocks=32,
                        max_model_len=128).create_config(light=True)
    (tmp_path / "config.bin").write_bytes(encode_config(config))
    monkeypatch.setenv("VX_CACHE_DIR", str(tmp_path))
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


# ----------------------------------------------------------------------------------- the executor it names
class NotAnExecutor:
    pass


@pytest.mark.parametrize("backend, message", [
    ("threads", "package.module"),
    ("tests.test_config", "package.module:ClassName"), ("a b:C", "package.module"), (":C", "package.module"),
    (3, "package.module"),
])
def test_bad_executor_backends_are_refused(tiny_model_dir, backend, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=tiny_model_dir, distributed_executor_backend=backend).validate()


def test_the_executor_class_is_the_one_the_config_names(tiny_model_dir):
    from vx.executor import UniProcExecutor
    from vx.executor.registry import executor_class

    def named(backend: str) -> VxConfig:
        return EngineArgs(model=tiny_model_dir, device="cpu",
                          distributed_executor_backend=backend).create_config(light=True)

    assert named("uni").parallel_config.distributed_executor_backend == "uni"
    assert executor_class(named("uni")) is UniProcExecutor
    assert executor_class(named("vx.executor:UniProcExecutor")) is UniProcExecutor
    with pytest.raises(ValueError, match="names no Executor subclass"):
        executor_class(named(f"{__name__}:NotAnExecutor"))
    with pytest.raises(ModuleNotFoundError):
        executor_class(named("no_such_module:Executor"))


# ------------------------------------------------------------------------------- parallelism (vLLM's names)
def test_parallel_sizes_pick_the_executor_and_cross_to_the_engine(tiny_model_dirs):
    from vx.executor.multiproc import MultiprocExecutor
    from vx.executor.registry import executor_class

    one = EngineArgs(model=tiny_model_dirs["qwen3"], device="cpu").create_config(light=True)
    assert one.parallel_config.distributed_executor_backend == "uni" and one.parallel_config.world_size == 1
    split = EngineArgs(model=tiny_model_dirs["llama"], device="cpu", tensor_parallel_size=2,
                       pipeline_parallel_size=3).create_config(light=True)
    pc = decode_config(encode_config(split)).parallel_config
    assert (pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.world_size) == (2, 3, 6)
    assert pc.distributed_executor_backend == "mp" and executor_class(split) is MultiprocExecutor


@pytest.mark.parametrize("family, args, message", [
    ("qwen3", dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive int"),
    ("qwen3", dict(pipeline_parallel_size=True), "pipeline_parallel_size must be a positive int"),
    ("qwen3", dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "need 'mp'"),
    ("qwen3", dict(tensor_parallel_size=3), "must divide the model's 4 attention heads"),
    ("llama", dict(pipeline_parallel_size=4), "exceeds the model's 3 layers"),
    ("gemma2", dict(tensor_parallel_size=2), "Gemma2ForCausalLM cannot be split over workers yet"),
])
def test_parallel_splits_the_model_cannot_take_are_refused(tiny_model_dirs, family, args, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=tiny_model_dirs[family], device="cpu", **args).create_config(light=True)


def test_ray_is_refused_when_it_is_not_installed(tiny_model_dir, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"needs Ray, which is not installed: pip install 'vx\[ray\]'"):
        EngineArgs(model=tiny_model_dir, tensor_parallel_size=2, distributed_executor_backend="ray").validate()


def test_kv_heads_fewer_than_ranks_are_replicated_not_refused(tiny_model_dirs):
    # The tiny Qwen3 has 2 KV heads: 4 ranks hold one replica each.
    config = EngineArgs(model=tiny_model_dirs["qwen3"], device="cpu", tensor_parallel_size=4).create_config(light=True)
    assert config.parallel_config.tensor_parallel_size == 4


# ------------------------------------------------------------------------------------------ quantization
def _with_quantization_config(src: str, dst, quant_config: dict) -> str:
    import json
    import shutil

    shutil.copytree(src, dst)
    with open(dst / "config.json") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quant_config
    with open(dst / "config.json", "w") as f:
        json.dump(cfg, f)
    return str(dst)


@pytest.mark.parametrize("light", [True, False])
def test_a_checkpoint_quantized_in_an_unknown_way_is_refused_naming_it(tiny_model_dir, tmp_path, light):
    """Loading such tensors as float weights gives a silently wrong model (an FP8 checkpoint's weights ~480x too
    large): the config refuses it, in the front end (light) as in the engine, before anything loads."""
    model = _with_quantization_config(tiny_model_dir, tmp_path / "m", {"quant_method": "bitnet", "bits": 1})
    with pytest.raises(ValueError, match="quantized with quant_method='bitnet', which vx cannot load"):
        EngineArgs(model=model, device="cpu").create_config(light=light)


def test_quantization_names_are_checked(tiny_model_dir):
    with pytest.raises(ValueError, match="quantization must be None or one of"):
        EngineArgs(model=tiny_model_dir, quantization="int3").validate()
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineArgs(model=tiny_model_dir, kv_cache_dtype="int3").validate()
    assert EngineArgs(model=tiny_model_dir, device="cpu").create_config().quant_config.method is None


def test_every_kv_cache_dtype_reaches_the_cache_config(tiny_model_dir):
    from vx.gpu.attention.registry import KV_CACHE_DTYPES

    assert KV_CACHE_DTYPES == ("auto", "fp8_e4m3", "int8")
    for kv in KV_CACHE_DTYPES:
        config = EngineArgs(model=tiny_model_dir, device="cpu", kv_cache_dtype=kv).create_config(light=True)
        assert config.cache_config.kv_cache_dtype == kv
