"""Engine defaults that scale with the CPU: `max_num_seqs`, the token budget and grammar threads from its cores.

`EngineArgs` applies them where the user left a field unset. Each rule rests on a measurement (figures, commands
and machines: docs/cpu_defaults.md).
"""

from __future__ import annotations

import os


CPU_SEQS_PER_CORE = 32
CPU_SEQS_PER_CORE_AMX = 64
CPU_BATCHED_TOKENS_PER_CORE = 256


def default_cpu_max_num_seqs(cores: int, amx: bool = False) -> int:
    """`max_num_seqs` on a CPU: 32 a core (the threads the engine runs), 64 where the CPU multiplies on AMX tiles,
    at most CUDA's 256.

    A decode step reads every weight once whatever its batch, while its arithmetic grows with the batch: tokens/s
    grows with the batch until the step waits for the cores' arithmetic rather than the weights' bytes, and that
    batch grows with the cores. Past it a larger cap buys no throughput and makes every step, and so every stream's
    next token, slower. AMX tiles do the arithmetic of many rows faster, so it binds at a larger batch (measured:
    docs/cpu_defaults.md).
    """
    return max(1, min(256, (CPU_SEQS_PER_CORE_AMX if amx else CPU_SEQS_PER_CORE) * cores))


def default_cpu_max_num_batched_tokens(cores: int) -> int:
    """`max_num_batched_tokens` on a CPU: 256 a core, at most CUDA's 8192.

    On a CPU the budget bounds a step's time, not its speed: a prompt is computed as fast in small chunks as in one
    large one, while every running stream waits for the whole step before its next token. 256 a core keeps a step's
    work per core, and so the pause a new prompt puts into every stream, the same on any machine (measured:
    docs/cpu_defaults.md).
    """
    return max(1, min(8192, CPU_BATCHED_TOKENS_PER_CORE * cores))


def default_grammar_compile_workers() -> int:
    """Grammar compile threads when `grammar_compile_workers` is None: half the cores, at least 2, at most 4.

    At least two, so that one slow compile never holds up the others (measured: docs/cpu_defaults.md); xgrammar
    releases the GIL while it compiles.
    """
    return max(2, min(4, (os.cpu_count() or 2) // 2))
