"""llama.cpp with parallel slots, driven through llama-cpp-python's low-level API as its server drives them.

llama-cpp-python's `Llama` runs one sequence at a time, so it cannot stand for llama.cpp's server with `-np N`
parallel slots. `ParallelSlots` does what that server's loop does for requests that arrive together: one context
holding `slots` sequences (`n_seq_max`), and every `llama_decode` call carrying one token for each sequence that is
generating plus as many waiting prompt tokens as fit in `n_batch` (continuous batching: a batch mixes decode and
prefill). Sampling is greedy, an argmax over the logits of the rows that sample, done for all rows at once in numpy
(cheaper than the server's per-slot sampler chain, so this favours llama.cpp if anything). End-of-sequence tokens
are ignored: every sequence generates exactly the tokens asked for.

Used by `benchmarks.batch_throughput`; llama-cpp-python must be installed.
"""

from __future__ import annotations

import logging
from typing import Any

# The server's defaults: a logical batch of 2048 tokens, split by llama_decode into physical batches of 512.
SERVER_N_BATCH = 2048
SERVER_N_UBATCH = 512


class ParallelSlots:
    """A llama.cpp model and one context with `slots` parallel sequences of up to `seq_len` tokens each."""

    def __init__(self, gguf_path: str, slots: int, seq_len: int, threads: int, kv_unified: bool = False,
                 n_batch: int = SERVER_N_BATCH, n_ubatch: int = SERVER_N_UBATCH) -> None:
        """`kv_unified=False` gives every sequence its own stretch of the KV cache, as the server does when it is
        given a number of slots (`-np N` without `--kv-unified`); True shares one buffer among them."""
        import llama_cpp as lc

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its log callback prints below ERROR
        self.lc = lc
        self.slots = slots
        self.n_batch = max(n_batch, slots)  # one decode token per sequence must fit in a batch
        lc.llama_backend_init()
        model_params = lc.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self.model = lc.llama_model_load_from_file(gguf_path.encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        ctx_params = lc.llama_context_default_params()
        ctx_params.n_ctx = slots * seq_len
        ctx_params.n_batch = self.n_batch
        ctx_params.n_ubatch = min(n_ubatch, self.n_batch)
        ctx_params.n_seq_max = slots
        ctx_params.n_threads = ctx_params.n_threads_batch = threads
        ctx_params.kv_unified = kv_unified
        self.ctx = lc.llama_init_from_model(self.model, ctx_params)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not make a context of {slots} sequences of {seq_len} tokens")
        if lc.llama_n_seq_max(self.ctx) < slots:
            raise RuntimeError(f"llama.cpp holds at most {lc.llama_n_seq_max(self.ctx)} sequences, not {slots}")
        self.n_batch = lc.llama_n_batch(self.ctx)  # llama.cpp caps it at the context size asked for
        if self.n_batch < slots:
            raise RuntimeError(f"llama.cpp's batch of {self.n_batch} tokens cannot hold one token per slot ({slots})")
        self.batch = lc.llama_batch_init(self.n_batch, 0, 1)

    def describe(self) -> str:
        """The context's shape, for a table's notes."""
        lc = self.lc
        return (f"{self.slots} slots in one context of {lc.llama_n_ctx(self.ctx)} tokens, n_batch {self.n_batch}, "
                f"n_ubatch {lc.llama_n_ubatch(self.ctx)}")

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """`new_tokens` greedy tokens after each prompt (at most `slots` prompts), all sequences decoded together."""
        import numpy as np

        lc, batch = self.lc, self.batch
        if not 1 <= len(prompts) <= self.slots or new_tokens < 1:
            raise ValueError(f"need 1 to {self.slots} prompts and new_tokens >= 1")
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)  # nothing of a previous call stays cached
        outs: list[list[int]] = [[] for _ in prompts]
        prefilled = [0] * len(prompts)  # prompt tokens of each sequence already in a batch
        waiting = list(range(len(prompts)))  # sequences whose prompt is not all in yet, in arrival order
        generating: list[int] = []  # sequences whose next token is known and must be decoded
        while waiting or generating:
            n = 0
            sampling: list[int] = []  # the sequence of each row that outputs logits, in batch order

            def add(seq: int, token: int, pos: int, logits: bool) -> None:
                nonlocal n
                batch.token[n] = token
                batch.pos[n] = pos
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq
                batch.logits[n] = logits
                if logits:
                    sampling.append(seq)
                n += 1

            # Decode tokens first, then prompt tokens in the room left (the server's order).
            for seq in generating:
                add(seq, outs[seq][-1], len(prompts[seq]) + len(outs[seq]) - 1, True)
            while waiting and n < self.n_batch:
                seq = waiting[0]
                take = min(len(prompts[seq]) - prefilled[seq], self.n_batch - n)
                for i in range(prefilled[seq], prefilled[seq] + take):
                    add(seq, prompts[seq][i], i, i == len(prompts[seq]) - 1)
                prefilled[seq] += take
                if prefilled[seq] == len(prompts[seq]):
                    waiting.pop(0)
            batch.n_tokens = n
            code = lc.llama_decode(self.ctx, batch)
            if code != 0:
                raise RuntimeError(f"llama_decode returned {code} on a batch of {n} tokens")
            logits = np.ctypeslib.as_array(lc.llama_get_logits(self.ctx), shape=(len(sampling), self.n_vocab))
            for seq, token in zip(sampling, logits.argmax(axis=1).tolist()):
                outs[seq].append(token)
            generating = [seq for seq in sampling if len(outs[seq]) < new_tokens]
        return outs

    def close(self) -> None:
        """Free the batch, the context and the model."""
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def __enter__(self) -> "ParallelSlots":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
