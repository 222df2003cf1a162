"""The engine's resolved configuration: `VxConfig` and its parts, one Struct per concern.

msgspec Structs: the front end resolves the config once (`EngineArgs.create_config`) and sends it whole to the engine
process (vx.config.wire), which uses it as it arrives.
"""

from __future__ import annotations

from typing import Any

import msgspec

from vx.config.hf_config import hf_head_dim, hf_is_mla, hf_num_kv_heads

SCHEDULING_POLICIES = ("fcfs", "priority")  # first come first served; lower `priority` value first
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
