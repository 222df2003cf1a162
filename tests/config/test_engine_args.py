"""vx/config/engine_args.py: the request-isolation limits (max_n_sequences, grammar compile limits), validated and
landing in one config place each; the CPU defaults; the executor and the parallel split the config names; the
quantization names."""

from __future__ import annotations

import pytest

from vx.config import EngineArgs, VxConfig, decode_config, encode_config
from vx.config.cpu_defaults import (default_cpu_max_num_batched_tokens, default_cpu_max_num_seqs,
                                    default_grammar_compile_workers)


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


# ----------------------------------------------------------------------------------- the executor it names
class NotAnExecutor:
    pass


@pytest.mark.parametrize("backend, message", [
    ("threads", "package.module"),
    ("tests.config.test_engine_args", "package.module:ClassName"), ("a b:C", "package.module"),
    (":C", "package.module"),
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
