"""How many KV-cache blocks an engine allocates, and why: the sizing rule, apart from the device that measures.

Each worker reports what a block costs and how much memory its device offers (`vx.kv_spec.KVCacheReport`); the
engine core (`vx.core.kv_cache_sizing`) turns those facts and the user's arguments into a number of blocks with a
reason the start-up log prints, through the rules here. It imports no torch, so the rules are tested on plain
numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

from vx.kv_spec import KVCacheGroupSpec, KVCacheSize

CPU_SEQUENCE_TOKENS = 512
"""Tokens the CPU default reserves for each of `max_num_seqs` sequences (see `size_kv_cache`).

The default workload's sequences are shorter than this on average: `vx bench throughput` draws prompts of 16-512
tokens and outputs of 16-256 (400 tokens a sequence on average), a chat turn of the demo a few hundred. A sequence
that runs longer still fits (the cache always holds one `max_model_len` sequence); only when most of `max_num_seqs`
sequences run long at once does the scheduler preempt one, to recompute it later. That workload (128 requests, seed
0, max_num_seqs 64, budget 512), run through the Scheduler and KVCacheManager with the no-op runner of
benchmarks/engine_overhead.py instead of the model, holds at most 1,673 blocks of 16 at once: 2,049 blocks (512
a sequence) run it with 0 preemptions and the old 5,825 alike; 1,537 blocks (384) preempt 23 times and compute
3.3% more tokens, 1,025 (256) 61 times and 12% more."""


# The CPU's cap: the KV cache shares RAM with everything else, so it takes at most this much of it by default.
CPU_MAX_KV_BYTES = 4 * 1024**3
CPU_MAX_RAM_FRACTION = 0.25


def cpu_kv_cap_bytes(available_ram_bytes: int) -> int:
    """The most the CPU default may take: min(4 GiB, a quarter of the RAM available now)."""
    return min(CPU_MAX_KV_BYTES, int(available_ram_bytes * CPU_MAX_RAM_FRACTION))


def kv_cache_groups(layer_windows: Sequence[int | None], num_blocks: int, block_size: int, max_num_seqs: int,
                    max_num_batched_tokens: int, rebalance: bool = True) -> tuple[KVCacheGroupSpec, ...]:
    """Split a cache of `num_blocks` blocks (over every layer) into one pool per attention kind (full attention
    first; a layer belongs to the group of its window), or () when every layer attends in full.

    A sliding-window group never needs more than its windows: each running sequence reads the blocks of its last
    `window` positions plus those of the chunk it computes, so it gets max_num_seqs * (ceil((window - 1) / bs) + 2)
    blocks plus the step's token budget's, and the null block (never more than `num_blocks`). The full-attention
    group gets the memory that leaves: at the same bytes, more blocks than one shared pool would have.
    A model whose every layer has the same window gets one pool of `num_blocks` that frees as it goes. With
    `rebalance=False` (the user set `num_kv_blocks`) every group keeps `num_blocks`.
    """
    kinds = sorted(set(layer_windows), key=lambda w: -1 if w is None else w)
    if kinds == [None]:
        return ()
    if len(kinds) == 1:
        return (KVCacheGroupSpec(num_blocks, kinds[0]),)
    budget_layer_blocks = num_blocks * len(layer_windows)  # one layer's block is the unit
    specs: list[KVCacheGroupSpec] = []
    for window in kinds:
        if window is None:
            continue
        need = max_num_seqs * (-(-(window - 1) // block_size) + 2) + -(-max_num_batched_tokens // block_size) + 1
        blocks = min(num_blocks, need) if rebalance else num_blocks
        specs.append(KVCacheGroupSpec(blocks, window))
        budget_layer_blocks -= blocks * layer_windows.count(window)
    if None in kinds:
        full_blocks = max(num_blocks, budget_layer_blocks // layer_windows.count(None)) if rebalance else num_blocks
        specs.insert(0, KVCacheGroupSpec(full_blocks, None))
    return tuple(specs)


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def size_kv_cache(*, device: str, block_size: int, bytes_per_block: int, max_model_len: int, max_num_seqs: int,
                  num_kv_blocks: int | None = None, kv_cache_memory_bytes: int | None = None,
                  device_budget_bytes: int = 0) -> KVCacheSize:
    """The KV cache's size: what the user asked for, else the device's default; never less than one sequence.

    - `num_kv_blocks` is taken as given (create_config checked that one `max_model_len` sequence fits).
    - `kv_cache_memory_bytes` is a budget: as many blocks as it holds, but no more than `max_num_seqs` sequences
      of `max_model_len` tokens can use.
    - CUDA's default is the same with `device_budget_bytes` (the share of GPU memory `gpu_memory_utilization`
      leaves after the model), as vLLM does: the GPU's memory serves nothing else.
    - The CPU's default comes from need: `max_num_seqs` sequences of `CPU_SEQUENCE_TOKENS` tokens (fewer when
      `max_model_len` is shorter), and at least one whole `max_model_len` sequence; cut to `device_budget_bytes`
      (the CPU's cap, `cpu_kv_cap_bytes`). On a CPU the cache shares RAM with everything else, and a block once
      written stays resident: a budget sized for the machine (the cap alone: 4 GiB for the default model, whose
      need on 2 cores is 1.4 GiB) only let the engine's RSS grow towards it as the prefix cache filled.

    Raises ValueError when the budget cannot hold one `max_model_len` sequence. The null block is counted in
    `num_blocks` and never in the tokens.
    """
    per_seq = _blocks_for(max_model_len, block_size)
    one_sequence = per_seq + 1  # + the null block
    usable = max_num_seqs * per_seq + 1
    sizing = dict(block_size=block_size, bytes_per_block=bytes_per_block)
    if num_kv_blocks is not None:
        return KVCacheSize(num_blocks=num_kv_blocks, source="num_kv_blocks",
                           reason="as num_kv_blocks asks", **sizing)
    if kv_cache_memory_bytes is not None or device != "cpu":
        budget = kv_cache_memory_bytes if kv_cache_memory_bytes is not None else device_budget_bytes
        source = "kv_cache_memory_bytes" if kv_cache_memory_bytes is not None else "gpu_memory_utilization"
        num = min(budget // bytes_per_block, usable)
        _check_one_sequence(num, one_sequence, budget, max_model_len)
        reason = (f"from {source} ({budget / 2**20:,.0f} MiB)" if num < usable else
                  f"all that max_num_seqs={max_num_seqs} sequences of max_model_len={max_model_len} can use, "
                  f"within {source} ({budget / 2**20:,.0f} MiB)")
        return KVCacheSize(num_blocks=int(num), source=source, reason=reason, **sizing)
    seq_tokens = min(max_model_len, CPU_SEQUENCE_TOKENS)
    need = max(one_sequence, max_num_seqs * _blocks_for(seq_tokens, block_size) + 1)
    cap = device_budget_bytes // bytes_per_block
    if need <= cap:
        return KVCacheSize(num_blocks=need, source="need", **sizing, reason=(
            f"from need: max(max_num_seqs={max_num_seqs} x {seq_tokens} tokens, one max_model_len={max_model_len} "
            f"sequence), under the CPU cap of {device_budget_bytes / 2**20:,.0f} MiB"))
    _check_one_sequence(cap, one_sequence, device_budget_bytes, max_model_len)
    return KVCacheSize(num_blocks=int(cap), source="cap", **sizing, reason=(
        f"cut to the CPU cap (min(4 GiB, 25% of available RAM): {device_budget_bytes / 2**20:,.0f} MiB); need was "
        f"{need * bytes_per_block / 2**20:,.0f} MiB (max_num_seqs={max_num_seqs} x {seq_tokens} tokens)"))


def _check_one_sequence(num: int, one_sequence: int, budget: int, max_model_len: int) -> None:
    if num < one_sequence:
        raise ValueError(
            f"The KV cache budget ({budget / 2**20:.0f} MiB) holds {num} blocks, fewer than one "
            f"sequence of max_model_len={max_model_len} needs ({one_sequence}); lower max_model_len or "
            "raise the memory budget.")
