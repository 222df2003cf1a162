"""Engine defaults that scale with the CPU: `max_num_seqs`, the token budget and grammar threads from its cores.

Each is measured (the figures are in the docstrings); `EngineArgs` applies them where the user left a field unset.
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
    batch grows with the cores. Measured on 2 cores (AMD EPYC, AVX2, no AVX-512; the default model's Q4_1 GGUF,
    float32; a shared machine, load 2-4), decode tokens/s at context ~128:
    `python -m benchmarks.decode_step --backends auto --modes compiled --batch 16,32,64,128 --context 128 --steps 4
    --repeats 5`: 157, 186, 213 and 218 tok/s at batch 16, 32, 64 and 128 (0.10, 0.17, 0.30, 0.59 s a step);
    eager steps (`--modes eager --batch 1,4,8,16,32,64,128 --repeats 3`): 16.9, 51.6, 89.0, 107, 126, 146 and 146.
    Flat from batch 64, i.e. 32 a core: a larger cap buys no throughput and makes every step, and so every
    stream's next token, slower. With AMX (bf16 tiles for the matmuls of many rows) arithmetic stops binding later:
    on 2 cores of an AMX Xeon, bf16, `--modes compiled --batch 32,64,128 --context 96 --repeats 3`: 854, 1,054 and
    1,211 tok/s (37.5, 60.7 and 106 ms a step), so 64 a core.
    """
    return max(1, min(256, (CPU_SEQS_PER_CORE_AMX if amx else CPU_SEQS_PER_CORE) * cores))


def default_cpu_max_num_batched_tokens(cores: int) -> int:
    """`max_num_batched_tokens` on a CPU: 256 a core, at most CUDA's 8192.

    On a CPU the budget bounds a step's time, not its speed: a prompt is computed as fast in chunks of 128 tokens as
    in one of 2048, while every running stream waits for the whole step before its next token. Measured on 2 cores
    (as above; load 8 from other jobs, so the absolute figures are slow, the ratios hold), `python -m
    benchmarks.prefill_chunk --rounds 3` (a 1024-token prompt): 168, 170, 177, 170 and 172 prompt tok/s at budgets
    128, 256, 512, 1024 and 2048, within the rounds' spread, and 0.76, 1.5, 2.9, 6.0 and 6.0 s a step. 256 a core
    keeps a step's work per core, and so the pause a new prompt puts into every stream, the same on any machine;
    on 2 cores it is 512, the default before, where a step with a full prefill chunk took 0.9 s on a quiet machine
    (`vx bench latency`: a 512-token prompt's first token).
    """
    return max(1, min(8192, CPU_BATCHED_TOKENS_PER_CORE * cores))


def default_grammar_compile_workers() -> int:
    """Grammar compile threads when `grammar_compile_workers` is None: half the cores, at least 2, at most 4.

    At least two, so that one slow compile never holds up the others: with one worker, a 15 ms schema waited
    0.44 s behind a 0.5 s one (measured on 2 cores, 49k-token vocabulary); with two, it took 2 ms. xgrammar
    releases the GIL while it compiles.
    """
    return max(2, min(4, (os.cpu_count() or 2) // 2))
