"""`EngineArgs`: the user's flat engine arguments (vLLM's names), checked and resolved into a `VxConfig`."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any

from vx import platform
from vx.config.checkpoint_files import check_checkpoint
from vx.config.cpu_defaults import (default_cpu_max_num_batched_tokens, default_cpu_max_num_seqs,
                                    default_grammar_compile_workers)
from vx.config.hf_config import (derive_max_model_len, eos_token_ids, hf_head_dim, hf_num_kv_heads, load_hf_config,
                                 read_hf_config_json, resolve_quantization)
from vx.config.model_source import resolve_model, resolve_tokenizer
from vx.config.vx_config import (DEFAULT_MAX_N_SEQUENCES, SCHEDULING_POLICIES, CacheConfig, DeviceConfig,
                                 ModelConfig, ParallelConfig, QuantConfig, SchedulerConfig, StructuredOutputsConfig,
                                 VxConfig)
from vx.models.registry import parallel_architectures, unsupported_architecture
from vx.gpu.attention.registry import ATTENTION_BACKEND_NAMES, KV_CACHE_DTYPES
from vx.models.layers.quantization.registry import QUANTIZATION_NAMES
from vx.models.layers.quantization.tp_split import check_quantized_split

_DTYPES = ("auto", *platform.DTYPE_NAMES)
_DEVICES = ("auto", "cpu", "cuda")
# The executors DESIGN.md names (vLLM's names); else "package.module:ClassName", an Executor subclass.
_EXECUTOR_BACKENDS = ("uni", "mp", "ray")

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
        resolve_model(self.model, convert=False)

    def create_config(self, light: bool = False) -> VxConfig:
        """Validate every field and resolve defaults (device, dtype, lengths) into a `VxConfig`.

        `light=True` reads config.json as plain JSON instead of through transformers (which imports torch):
        for a front end that never runs the model and takes the exact limits from the engine's handshake.
        """
        self._check_scalars()
        platform.prefer_openmp_wait_policy()  # before transformers loads torch
        device = platform.resolve_device(self.device)
        model_path = resolve_model(self.model)
        hf_config = read_hf_config_json(model_path) if light else load_hf_config(model_path)
        archs = list(getattr(hf_config, "architectures", None) or [])
        if not archs:
            raise ValueError(f"{model_path}/config.json names no 'architectures'; cannot pick a model class.")
        if (reason := unsupported_architecture(archs[0])) is not None:
            raise ValueError(f"{model_path}: {reason}")
        check_checkpoint(model_path, hf_config)
        dtype = platform.resolve_dtype(self.dtype, device, hf_config)
        derived_max = derive_max_model_len(hf_config)
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
            tokenizer=resolve_tokenizer(self.tokenizer) if self.tokenizer else model_path,
            hf_config=hf_config,
            architecture=archs[0],
            dtype=dtype,
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            eos_token_ids=eos_token_ids(model_path, hf_config),
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
        for name, allowed in (("dtype", _DTYPES), ("device", _DEVICES), ("scheduling_policy", SCHEDULING_POLICIES),
                              ("kv_cache_dtype", KV_CACHE_DTYPES), ("attention_backend", ATTENTION_BACKEND_NAMES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}.")
        if self.quantization is not None and self.quantization not in QUANTIZATION_NAMES:
            raise ValueError(f"quantization must be None or one of {QUANTIZATION_NAMES}, got {self.quantization!r}.")
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
    if architecture not in parallel_architectures():
        raise ValueError(f"tensor_parallel_size={tp} x pipeline_parallel_size={pp}: {architecture} cannot be split "
                         f"over workers yet; these can: {', '.join(parallel_architectures())}.")
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
