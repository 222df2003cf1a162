"""Engine configuration: flat user-facing `EngineArgs`, validated into a structured `VxConfig`.

`VxConfig` and its parts are msgspec Structs: the front end resolves the config once and sends it whole to the
engine process (`encode_config` / `decode_config`), which uses it as it arrives.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any

import msgspec

from vx import platform
from vx.cpu_defaults import (default_cpu_max_num_batched_tokens, default_cpu_max_num_seqs,
                             default_grammar_compile_workers)
from vx.checkpoint_files import check_checkpoint
from vx.model_architectures import PARALLEL_ARCHITECTURES, unsupported_architecture
from vx.model_limits import check_model_config
from vx.hf_config import (HFConfig, ResolvedHFConfig, config_fields, hf_head_dim, hf_is_mla, hf_kv_cache_dims,
                          hf_num_kv_heads, resolve_hf_config)
from vx.gpu.attention.registry import ATTENTION_BACKEND_NAMES, KV_CACHE_DTYPES
from vx.models.layers.quantization.registry import QUANTIZATION_NAMES
from vx.models.layers.quantization.tp_split import check_quantized_split

_DTYPES = ("auto", *platform.DTYPE_NAMES)
_DEVICES = ("auto", "cpu", "cuda")
SCHEDULING_POLICIES = ("fcfs", "priority")  # first come first served; lower `priority` value first
# The executors DESIGN.md names (vLLM's names); else "package.module:ClassName", an Executor subclass.
_EXECUTOR_BACKENDS = ("uni", "mp", "ray")

DEFAULT_MAX_N_SEQUENCES = 128  # OpenAI's own limit on `n`


class ModelConfig(msgspec.Struct, kw_only=True):
    """Which model to run and how its numbers are stored."""

    model: str
    tokenizer: str
    # A transformers config; an `HFConfig` (config.json as read) in a front end that must not import torch. It
    # crosses to the engine process as its fields and arrives as an `HFConfig` of every resolved field (`decode_config`).
    hf_config: Any
    architecture: str
    dtype: str  # resolved: float32 | bfloat16 | float16
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    seed: int = 0

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        return hf_num_kv_heads(self.hf_config)

    @property
    def head_dim(self) -> int:
        return hf_head_dim(self.hf_config)

    @property
    def attn_logits_soft_cap(self) -> float | None:
        """Gemma 2's cap on attention scores (scores -> cap * tanh(scores / cap)); None: not capped."""
        cap = getattr(self.hf_config, "attn_logit_softcapping", None)
        return float(cap) if cap is not None else None

    @property
    def is_mla(self) -> bool:
        """Whether the model's attention is Multi-head Latent Attention (DeepSeek-V2): see `hf_kv_cache_dims`."""
        return hf_is_mla(self.hf_config)


class CacheConfig(msgspec.Struct, kw_only=True):
    """Paged KV cache: block size, how many blocks (or a memory budget), prefix caching."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # The KV cache's storage: "auto" (the model dtype) or a smaller one (vx.gpu.attention.registry.KV_CACHE_DTYPES).
    kv_cache_dtype: str = "auto"


class SchedulerConfig(msgspec.Struct, kw_only=True):
    """Continuous-batching limits per step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" | "priority" (lower `priority` value first)
    # The most parallel samples (`SamplingParams.n`) one request may ask for; the front end refuses more.
    max_n_sequences: int = DEFAULT_MAX_N_SEQUENCES


class DeviceConfig(msgspec.Struct, kw_only=True):
    """Where the model runs and which attention backend computes it."""

    device: str = "cpu"  # resolved: cpu | cuda
    attention_backend: str = "auto"
    enforce_eager: bool = False
    # torch's threads in the engine on a CPU (`platform.cpu_threads()`: OMP_NUM_THREADS, else the physical cores the
    # process may use); 0 leaves torch's own choice (CUDA).
    cpu_threads: int = 0


class StructuredOutputsConfig(msgspec.Struct, kw_only=True):
    """Limits on compiling structured-output grammars (in the engine process)."""

    cache_memory_bytes: int = 256 * 2**20  # compiled grammars kept for reuse, by xgrammar's memory_size_bytes
    max_grammar_memory_bytes: int = 64 * 2**20  # a larger compiled grammar fails its request
    compile_timeout_s: float = 10.0  # a longer compile fails its request; its thread runs on, discarded
    compile_workers: int = 2  # compiles that run at once (and mask threads in each lane)
    # The longest a step waits for a next-token mask; a grammar whose masks take longer is refused at compile
    # (timed on a sample path) or failed once several of its masks took longer.
    mask_budget_s: float = 0.1


class ParallelConfig(msgspec.Struct, kw_only=True):
    """How the model is split over workers (tensor-parallel ranks x pipeline stages) and the executor that reaches
    them."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # "uni" (one worker in the engine's process), "mp" (a worker process per rank), "ray" (a Ray actor per rank), or
    # "package.module:ClassName" of an `Executor` subclass, imported in the engine process (`vx.executor.registry`): a test's faulty executor, say.
    distributed_executor_backend: str = "uni"
    # The worker class of the multiprocess executor's processes: "auto" (vx.gpu.worker.Worker), or
    # "package.module:ClassName" of a subclass (vLLM's `worker_cls`; the tests inject faulty workers this way).
    worker_cls: str = "auto"

    @property
    def world_size(self) -> int:
        """Workers in all: one per (pipeline stage, tensor-parallel rank)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


class QuantConfig(msgspec.Struct, kw_only=True):
    """How the model's weights are stored: the quantization method (a row of vx.models.layers.quantization.registry),
    resolved from the checkpoint's `quantization_config` (whose details the method reads from
    `ModelConfig.hf_config`), a GGUF file's tensor types, or `quantization=`; None: float weights in the model
    dtype."""

    method: str | None = None


class VxConfig(msgspec.Struct, kw_only=True):
    """Everything the engine needs, checked and resolved."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig
    parallel_config: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    structured_outputs_config: StructuredOutputsConfig = msgspec.field(default_factory=StructuredOutputsConfig)
    quant_config: QuantConfig = msgspec.field(default_factory=QuantConfig)


_STRUCTURED_DEFAULTS = StructuredOutputsConfig()


@dataclass
class EngineArgs:
    """User-facing engine arguments, named as in vLLM. `create_config()` validates them."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # None: "uni" for one worker, "mp" for several (vLLM's default on one machine).
    distributed_executor_backend: str | None = None
    worker_cls: str = "auto"
    seed: int = 0
    max_n_sequences: int = DEFAULT_MAX_N_SEQUENCES
    grammar_cache_memory_bytes: int = _STRUCTURED_DEFAULTS.cache_memory_bytes
    max_grammar_memory_bytes: int = _STRUCTURED_DEFAULTS.max_grammar_memory_bytes
    grammar_compile_timeout_s: float = _STRUCTURED_DEFAULTS.compile_timeout_s
    grammar_compile_workers: int | None = None  # None: max(2, min(4, cores // 2))
    grammar_mask_budget_s: float = _STRUCTURED_DEFAULTS.mask_budget_s
    quantization: str | None = None  # None: as the checkpoint is (quantized or not); else quantize at load
    kv_cache_dtype: str = "auto"

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> "EngineArgs":
        """Build from keyword arguments, refusing unknown names with the list of known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"Unknown engine argument(s): {', '.join(unknown)}. Known: {', '.join(sorted(known))}."
            )
        return cls(model=model, **kwargs)

    def validate(self) -> None:
        """The cheap checks: every scalar field, and that the model exists (no loading, no GGUF conversion)."""
        self._check_scalars()
        from vx.model_source import resolve_model

        resolve_model(self.model, convert=False)

    def create_config(self, light: bool = False) -> VxConfig:
        """Validate every field and resolve defaults (device, dtype, lengths) into a `VxConfig`.

        `light=True` reads config.json as plain JSON instead of through transformers (which imports torch):
        for a front end that never runs the model and takes the exact limits from the engine's handshake.
        """
        self._check_scalars()
        platform.prefer_openmp_wait_policy()  # before transformers loads torch
        device = platform.resolve_device(self.device)
        model_path = _resolve_model_path(self.model)
        hf_config = _read_hf_config_json(model_path) if light else _load_hf_config(model_path)
        archs = list(getattr(hf_config, "architectures", None) or [])
        if not archs:
            raise ValueError(f"{model_path}/config.json names no 'architectures'; cannot pick a model class.")
        if (reason := unsupported_architecture(archs[0])) is not None:
            raise ValueError(f"{model_path}: {reason}")
        check_checkpoint(model_path, hf_config)
        dtype = platform.resolve_dtype(self.dtype, device, hf_config)
        derived_max = _derive_max_model_len(hf_config)
        if self.max_model_len is None:
            max_model_len = min(derived_max, 8192) if derived_max else 2048
        else:
            max_model_len = self.max_model_len
            if derived_max and max_model_len > derived_max:
                raise ValueError(
                    f"max_model_len={max_model_len} exceeds the model's limit of {derived_max} tokens."
                )
        vocab_size = int(hf_config.vocab_size)
        model_config = ModelConfig(
            model=model_path,
            tokenizer=_resolve_tokenizer_path(self.tokenizer) if self.tokenizer else model_path,
            hf_config=hf_config,
            architecture=archs[0],
            dtype=dtype,
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            eos_token_ids=_eos_token_ids(model_path, hf_config),
            seed=self.seed,
        )
        cpu_threads = platform.cpu_threads() if device == "cpu" else 0
        if self.max_num_seqs is not None:
            max_num_seqs = self.max_num_seqs
        else:
            max_num_seqs = (default_cpu_max_num_seqs(cpu_threads, "amx_bf16" in platform.cpu_flags())
                            if device == "cpu" else 256)
        if self.max_num_batched_tokens is not None:
            budget = self.max_num_batched_tokens
        else:
            budget = default_cpu_max_num_batched_tokens(cpu_threads) if device == "cpu" else 8192
            if not self.enable_chunked_prefill:
                budget = max(budget, max_model_len)
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) must be >= max_model_len ({max_model_len}) "
                "when chunked prefill is disabled."
            )
        cache = CacheConfig(
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        if self.num_kv_blocks is not None:
            # +1: block 0 is reserved as the padding block.
            blocks_per_seq = -(-max_model_len // self.block_size) + 1
            if self.num_kv_blocks < blocks_per_seq:
                raise ValueError(
                    f"num_kv_blocks={self.num_kv_blocks} cannot hold one sequence of max_model_len="
                    f"{max_model_len} ({blocks_per_seq} blocks of {self.block_size}, one of them reserved); raise it or lower "
                    "max_model_len."
                )
        sched = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            enable_chunked_prefill=self.enable_chunked_prefill,
            policy=self.scheduling_policy,
            max_n_sequences=self.max_n_sequences,
        )
        dev = DeviceConfig(device=device, attention_backend=self.attention_backend,
                           enforce_eager=self.enforce_eager, cpu_threads=cpu_threads)
        structured = StructuredOutputsConfig(
            cache_memory_bytes=self.grammar_cache_memory_bytes,
            max_grammar_memory_bytes=self.max_grammar_memory_bytes,
            compile_timeout_s=float(self.grammar_compile_timeout_s),
            compile_workers=self.grammar_compile_workers or default_grammar_compile_workers(),
            mask_budget_s=float(self.grammar_mask_budget_s),
        )
        quant_method = resolve_quantization(self.quantization, hf_config)
        parallel = ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                  pipeline_parallel_size=self.pipeline_parallel_size,
                                  distributed_executor_backend=self.executor_backend(), worker_cls=self.worker_cls)
        check_parallel_split(parallel, hf_config, archs[0], quant_method)
        return VxConfig(model_config=model_config, cache_config=cache, scheduler_config=sched, device_config=dev,
                        parallel_config=parallel, structured_outputs_config=structured,
                        quant_config=QuantConfig(method=quant_method))

    def executor_backend(self) -> str:
        """`distributed_executor_backend`, its default resolved: "uni" for one worker, "mp" for several."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.tensor_parallel_size * self.pipeline_parallel_size == 1 else "mp"

    def _check_scalars(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}.")
        if self.device not in _DEVICES:
            raise ValueError(f"device must be one of {_DEVICES}, got {self.device!r}.")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got "
                             f"{self.scheduling_policy!r}.")
        if self.quantization is not None and self.quantization not in QUANTIZATION_NAMES:
            raise ValueError(f"quantization must be None or one of {QUANTIZATION_NAMES}, got {self.quantization!r}.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}.")
        if self.attention_backend not in ATTENTION_BACKEND_NAMES:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKEND_NAMES}, "
                             f"got {self.attention_backend!r}.")
        for name in ("max_model_len", "num_kv_blocks", "kv_cache_memory_bytes", "max_num_seqs",
                     "max_num_batched_tokens", "grammar_compile_workers"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}.")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1 \
                or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size!r}.")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}.")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}.")
        backend = self.executor_backend()
        _check_executor_backend(backend)
        if self.worker_cls != "auto" and not _is_class_path(self.worker_cls):
            raise ValueError(f"worker_cls must be 'auto' or 'package.module:ClassName' (a vx.gpu.worker.Worker "
                             f"subclass), got {self.worker_cls!r}.")
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if backend == "uni" and world > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one worker in the engine's process; "
                             f"tensor_parallel_size x pipeline_parallel_size = {world} workers need 'mp' (a process "
                             "per rank) or 'ray'.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}.")
        for name in ("max_n_sequences", "grammar_cache_memory_bytes", "max_grammar_memory_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v < 2**63:
                raise ValueError(f"{name} must be a positive int, got {v!r}.")
        for name in ("grammar_compile_timeout_s", "grammar_mask_budget_s"):
            t = getattr(self, name)
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {t!r}.")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}.")


def _check_executor_backend(backend: Any) -> None:
    """A known backend name, or the form of a "package.module:ClassName" (imported only in the engine process)."""
    if backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ValueError("distributed_executor_backend='ray' needs Ray, which is not installed: pip install "
                         "'vx[ray]' (or 'ray>=2.40').")
    if backend in _EXECUTOR_BACKENDS:
        return
    if not _is_class_path(backend):
        raise ValueError(f"distributed_executor_backend must be one of {_EXECUTOR_BACKENDS} or "
                         f"'package.module:ClassName' (an Executor subclass), got {backend!r}.")


def _is_class_path(value: Any) -> bool:
    """Whether `value` has the form "package.module:ClassName"."""
    module, _, name = value.partition(":") if isinstance(value, str) else ("", "", "")
    return all(part.isidentifier() for part in module.split(".")) and name.isidentifier()


def check_parallel_split(parallel: ParallelConfig, hf_config: Any, architecture: str, quant_method: str | None,
                         ) -> None:
    """The model can be split as `parallel` asks: a family whose layers shard, attention heads (and KV heads, or
    ranks over KV heads: each rank then holds a replica) divisible by the tensor-parallel ranks, at least one layer
    a pipeline stage, quantized weights only in a format that splits, aligned to its blocks or groups per rank
    (vx.models.layers.quantization.tp_split). ValueError naming the field."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if tp * pp == 1:
        return
    if architecture not in PARALLEL_ARCHITECTURES:
        raise ValueError(f"tensor_parallel_size={tp} x pipeline_parallel_size={pp}: {architecture} cannot be split "
                         f"over workers yet; these can: {', '.join(sorted(PARALLEL_ARCHITECTURES))}.")
    heads, kv_heads = int(hf_config.num_attention_heads), hf_num_kv_heads(hf_config)
    if heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's {heads} attention heads.")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's {kv_heads} KV heads, or be a multiple "
                         "of them (each rank then holds a replica of one).")
    layers = int(hf_config.num_hidden_layers)
    if pp > layers:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {layers} layers (each stage needs one).")
    check_quantized_split(quant_method, hf_config, tp, hf_head_dim(hf_config), kv_heads)


def checkpoint_quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's `quantization_config` as a dict (None when it has none)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    return dict(qc) if isinstance(qc, dict) else dict(qc.to_dict())


def resolve_quantization(requested: str | None, hf_config: Any) -> str | None:
    """The quantization method the model runs with: the checkpoint's own (its `quantization_config.quant_method`),
    else `requested` (quantize float weights at load), else None. A method vx cannot load is a `ValueError` naming
    it: loading its tensors as float weights would give a silently wrong model."""
    checkpoint = checkpoint_quantization_config(hf_config)
    if checkpoint is None:
        return requested
    method = str(checkpoint.get("quant_method", "")).lower()
    if method not in QUANTIZATION_NAMES:
        raise ValueError(f"The checkpoint is quantized with quant_method={method!r}, which vx cannot load; vx loads "
                         f"{', '.join(QUANTIZATION_NAMES) or 'no quantized checkpoints yet'}.")
    if requested is not None and requested != method:
        raise ValueError(f"quantization={requested!r} was asked for, but the checkpoint is quantized with "
                         f"{method!r}; leave quantization unset to load it as it is.")
    return method


def _resolve_model_path(model: str | None) -> str:
    from vx.model_source import resolve_model

    return resolve_model(model)


def _resolve_tokenizer_path(tokenizer: str) -> str:
    from vx.model_source import resolve_tokenizer

    return resolve_tokenizer(tokenizer)


def _load_hf_config(path: str) -> Any:
    from transformers import AutoConfig

    # As the file says first: transformers' config classes build per-layer lists from the layer count, and so on.
    check_model_config(read_json(os.path.join(path, "config.json")), f"{path}/config.json")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers raises many kinds here
        raise ValueError(f"Could not read the model config in {path!r}: {e}") from e
    check_model_config(config, f"{path}/config.json (with its model type's defaults)")
    return config


def encode_config(config: VxConfig) -> bytes:
    """`config` whole, as msgpack: what the engine process receives. The HF config goes as [fields, resolved]: a
    transformers config's `to_dict()` is resolved already, config.json as a light front end read it is not."""
    mc = config.model_config
    if mc.hf_config is not None:  # its own form: msgspec would take a transformers config apart
        resolved = not isinstance(mc.hf_config, HFConfig) or isinstance(mc.hf_config, ResolvedHFConfig)
        config = msgspec.structs.replace(config, model_config=msgspec.structs.replace(
            mc, hf_config=[config_fields(mc.hf_config), resolved]))
    return msgspec.msgpack.encode(config)


def decode_config(data: bytes) -> VxConfig:
    """The `VxConfig` of `encode_config`, every field as it was sent; the HF config becomes an `HFConfig` of every
    field transformers resolves (without importing transformers, once the fields' resolution is cached)."""
    config = msgspec.msgpack.decode(data, type=VxConfig)
    mc = config.model_config
    if mc.hf_config is not None:
        fields, resolved = mc.hf_config
        mc.hf_config = ResolvedHFConfig(fields) if resolved else resolve_hf_config(fields, mc.model)
    return config


def _read_hf_config_json(path: str) -> HFConfig:
    raw = read_json(os.path.join(path, "config.json"))
    if not raw:
        raise ValueError(f"Could not read the model config in {path!r}: config.json is missing or not JSON.")
    if not isinstance(raw.get("vocab_size"), int):
        raise ValueError(f"{path}/config.json has no integer 'vocab_size'.")
    check_model_config(raw, f"{path}/config.json")
    return HFConfig(raw)


def _derive_max_model_len(hf_config: Any) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        v = getattr(hf_config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _eos_token_ids(path: str, hf_config: Any) -> list[int]:
    ids: list[int] = []
    for source in (hf_config.to_dict(), read_json(os.path.join(path, "generation_config.json"))):
        eos = source.get("eos_token_id")
        if isinstance(eos, int):
            eos = [eos]
        for e in eos or []:
            if isinstance(e, int) and e not in ids:
                ids.append(e)
    return ids


def read_json(path: str) -> dict[str, Any]:
    """A JSON object file of a model directory; {} when it is missing, unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError):  # RecursionError: arrays or objects nested thousands deep
        return {}
    return data if isinstance(data, dict) else {}
