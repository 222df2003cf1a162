"""The KV-sizing types: what each worker reports about its KV cache, and the size the engine core decides from them.

msgspec Structs in a leaf module that imports neither `vx.core`, `vx.gpu` nor `vx.cache`, as vLLM v1's
`KVCacheSpec` / `KVCacheConfig`: every worker reports (`KVCacheReport`), the engine core decides once for all ranks
(`vx.core.kv_cache_sizing`), and one `initialize_kv_cache` call carries the decision (`KVCacheSize`) down to every
worker, which allocates what it is told.
"""

from __future__ import annotations

import msgspec


class KVCacheGroupSpec(msgspec.Struct, frozen=True):
    """One group of layers: the blocks of their pool and their attention kind (crosses to the engine whole)."""

    num_blocks: int
    sliding_window: int | None = None  # None: full attention


class KVCacheReport(msgspec.Struct, frozen=True, kw_only=True):
    """What one worker tells the engine core before the KV cache exists: its layers, a block's cost, its memory.

    The worker measures and nothing more; the rule that turns reports into blocks lives in the engine core, so every
    rank gets the same answer from one decision.
    """

    rank: int = 0
    pipeline_stage: int = 0  # the stage whose layers this rank holds (a shard of them under tensor parallelism)
    device: str  # "cuda" or "cpu": which rule reads the memory below
    # Each of this rank's attention layers' sliding window (None: full attention), in layer order.
    layer_windows: tuple[int | None, ...]
    bytes_per_block: int  # one block of `block_size` tokens, K and V, over this rank's layers
    memory_total_bytes: int  # the device's memory (CUDA) or the machine's RAM (CPU)
    memory_free_bytes: int  # free now, with the model loaded (CUDA), or the RAM available now (CPU)


class KVCacheSize(msgspec.Struct, frozen=True, kw_only=True):
    """The KV cache an engine allocates: `num_blocks` blocks (the null block included) of `block_size` tokens.

    `source` names what decided the size: "num_kv_blocks" or "kv_cache_memory_bytes" (the user's), "need" (the CPU
    default: what `max_num_seqs` sequences need), "cap" (the CPU default, cut to its memory cap) or
    "gpu_memory_utilization" (CUDA's default); `reason` says it in words for the start-up log.
    """

    num_blocks: int
    block_size: int
    bytes_per_block: int
    source: str
    reason: str
    # One per attention kind when the model has sliding-window layers (`vx.cache.kv_cache_size.kv_cache_groups`);
    # empty: one group of `num_blocks` blocks, full attention, in every layer.
    groups: tuple[KVCacheGroupSpec, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Tokens the usable blocks hold (block 0 is the reserved null block)."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def num_bytes(self) -> int:
        """Bytes of every block's K and V over all layers, the null block included."""
        return self.num_blocks * self.bytes_per_block

    def describe(self) -> str:
        """One line for the start-up log: size, blocks, tokens, and why that size."""
        line = (f"KV cache {self.num_bytes / 2**20:,.1f} MiB: {self.num_blocks:,} KV blocks of {self.block_size} "
                f"tokens ({self.num_tokens:,} tokens), {self.reason}")
        if self.groups:
            kinds = ["full-attention" if g.sliding_window is None else f"window-{g.sliding_window}"
                     for g in self.groups]
            line += "; as " + ", ".join(f"{g.num_blocks:,} blocks for the {kind} layers"
                                        for g, kind in zip(self.groups, kinds))
        return line
