"""Runs the model for one scheduled step: build inputs, forward, logits for sampling rows, sample."""

from __future__ import annotations

import logging

import numpy as np
import torch

from vx.config import VxConfig, checkpoint_quantization_config, hf_kv_cache_dims
from vx.distributed import ParallelGroups
from vx.gpu.attention import get_attn_backend
from vx.gpu.attention.backend import CommonAttentionMetadata
from vx.gpu.graphs import DecodeGraphs, build_decode_graphs
from vx.gpu.grammar_bitmask import apply_grammar_bitmask
from vx.gpu.input_batch import CachedRequestState, InputBatch, StepInputs
from vx.gpu.kv_cache import attention_layers, bind_kv_caches, bytes_per_block, layers_bytes_per_block
from vx.gpu.pooler import pool_step
from vx.gpu.sampler import LogprobsTensors, Sampler, gather_logprobs
from vx.gpu.sampling_metadata import SamplingMetadata
from vx.kv_spec import KVCacheGroupSpec
from vx.models.layers.quantization import get_quantization_config
from vx.models.loader import DefaultModelLoader
from vx.platform import torch_dtype
from vx.step import ModelRunnerOutput, SchedulerOutput, TokenLogprobs

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, its KV cache tensors, the persistent batch state and the sampler.

    One of several ranks (`groups`) holds its shard of its pipeline stage: every rank of a stage runs the same
    forward (their collectives meet), a stage that is not the first receives the previous stage's hidden states and
    one that is not the last sends its own on; only the output rank (the last stage's first tensor-parallel rank)
    samples and returns tokens.
    """

    def __init__(self, config: VxConfig, device: torch.device, groups: ParallelGroups | None = None) -> None:
        self.config = config
        self.groups = groups if groups is not None and groups.world_size > 1 else None
        self.is_first_stage = self.groups is None or self.groups.pp.is_first_rank
        self.is_last_stage = self.groups is None or self.groups.pp.is_last_rank
        self.is_output_rank = self.is_last_stage and (self.groups is None or self.groups.tp.is_first_rank)
        self.model_config = config.model_config
        self.device = device
        self.dtype = torch_dtype(config.model_config.dtype)
        self.block_size = config.cache_config.block_size
        self.kv_cache_dtype = config.cache_config.kv_cache_dtype
        self.input_batch = InputBatch(self.block_size, device)
        self.sampler = Sampler()
        self.model: torch.nn.Module | None = None
        self.attn_backend = get_attn_backend(
            config.device_config.attention_backend, device.type, dtype=self.dtype,
            block_size=self.block_size, head_dim=hf_kv_cache_dims(config.model_config.hf_config)[1],
            kv_cache_dtype=self.kv_cache_dtype, mla=config.model_config.is_mla,
            logits_soft_cap=config.model_config.attn_logits_soft_cap is not None)
        self.kv_caches: list[torch.Tensor] = []
        self.kv_cache_groups: tuple[KVCacheGroupSpec, ...] = ()  # empty: one group, every layer in full
        self.num_kv_blocks = 0
        self.decode_graphs: DecodeGraphs | None = None

    def load_model(self) -> None:
        mc = self.model_config
        quant_config = get_quantization_config(self.config.quant_config.method,
                                               checkpoint_quantization_config(mc.hf_config))
        groups = {} if self.groups is None else {"tp_group": self.groups.tp, "pp_group": self.groups.pp}
        self.model = DefaultModelLoader().load_model(mc.model, mc.hf_config, self.dtype, self.device, quant_config,
                                                     **groups)

    def kv_cache_bytes_per_block(self) -> int:
        """A block's bytes over this rank's layers (all of them, or its stage's shard of them)."""
        if self.groups is not None:
            return layers_bytes_per_block(attention_layers(self.model), self.block_size, self.dtype,
                                          self.attn_backend, self.kv_cache_dtype)
        return bytes_per_block(self.model_config, self.block_size, self.dtype, self.attn_backend, self.kv_cache_dtype)

    def layer_windows(self) -> list[int | None]:
        """Each attention layer's sliding window (None: full attention), in layer order."""
        assert self.model is not None, "load_model() first"
        return [layer.sliding_window for layer in attention_layers(self.model)]

    def initialize_kv_cache(self, num_blocks: int, groups: tuple[KVCacheGroupSpec, ...] = ()) -> None:
        """Allocate and bind the layers' caches: `num_blocks` each, or their group's (`groups`, one per attention
        kind)."""
        assert self.model is not None, "load_model() first"
        self.kv_cache_groups = groups
        self.num_kv_blocks = num_blocks
        self.kv_caches = bind_kv_caches(self.model, self.attn_backend, num_blocks, self.block_size,
                                        self.dtype, self.device, self.kv_cache_dtype, groups)
        # Decode graphs (compiled on the CPU, CUDA graphs on CUDA), unless this runner runs eagerly.
        self.decode_graphs = build_decode_graphs(self.model, self.config, self.device, self.attn_backend,
                                                 num_blocks, groups, several_ranks=self.groups is not None)

    def shutdown(self) -> None:
        """Stop the background decode compiler (it ends after the size it is compiling)."""
        if self.decode_graphs is not None:
            self.decode_graphs.shutdown()

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Compute the scheduled tokens and sample one token for each request that reached its end (a pooling
        request pools its hidden states instead, see vx/gpu/pooler.py).

        Work that belongs to one request (its sampling state, its sampling, its prompt logprobs) fails that request
        alone: it is reported in `ModelRunnerOutput.failed`, and the others sample as they would have. Only a
        failure of the batch's forward pass raises (and ends the engine).
        """
        if self.decode_graphs is None:
            return self._execute(scheduler_output)
        with self.decode_graphs.step():  # sizes queued for compiling wait until no step runs
            return self._execute(scheduler_output)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        failed = self.input_batch.update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], [], failed=failed)
        inp = self.input_batch.prepare(scheduler_output)
        # Every scheduled request runs, a failed one too: its blocks may be shared with another request that reads
        # them in this very step (prefix caching registers blocks when they are allocated).
        hidden = self._forward(scheduler_output, inp)
        if not self.is_last_stage:
            return ModelRunnerOutput([], [], failed=failed)
        prompt_logprobs = self._prompt_logprobs(scheduler_output, inp.query_start_loc, hidden, failed)
        pooled = None
        if inp.pooling_rows:  # embedding requests: their hidden states, pooled; they sample nothing
            batch_states = [self.input_batch.states[req_id] for req_id in scheduler_output.req_ids]
            pooled = pool_step(batch_states, inp.pooling_rows, hidden, inp.query_start_loc, inp.seq_lens, failed)
        rows = [i for i, req_id in enumerate(inp.sampling_req_ids) if req_id not in failed]
        if not rows:
            return ModelRunnerOutput([], [], prompt_logprobs=prompt_logprobs, failed=failed, pooled=pooled)
        logits = self.model.compute_logits(hidden[inp.logits_indices.to(self.device)])
        if scheduler_output.grammar_bitmask is not None:
            # Before sampling, so greedy and random rows (and the logits processors) see only allowed tokens.
            apply_grammar_bitmask(logits, scheduler_output.grammar_bitmask, scheduler_output.grammar_req_ids,
                                  inp.sampling_req_ids)
        if not self.is_output_rank:  # its logits were this rank's part of the gather; the output rank samples
            return ModelRunnerOutput([], [], failed=failed)
        if len(rows) < len(inp.sampling_req_ids):
            logits = logits[torch.tensor(rows, device=self.device)]
        states = [inp.sampling_states[i] for i in rows]
        states, sampled, row_logprobs = self._sample(logits, states, failed)
        return ModelRunnerOutput([s.req_id for s in states], sampled, row_logprobs, prompt_logprobs, failed, pooled)

    def _forward(self, scheduler_output: SchedulerOutput, inp: StepInputs) -> torch.Tensor:
        """The step's hidden states [T, hidden]: through a compiled decode graph when the step is decode-only and
        its size is compiled, else eagerly."""
        num_reqs = scheduler_output.num_reqs
        if (self.decode_graphs is not None and inp.max_query_len == 1
                and scheduler_output.total_num_scheduled_tokens == num_reqs):
            size = self.decode_graphs.graph_size(num_reqs)
            if size is not None:
                return self.decode_graphs.run(size, inp.input_ids, inp.positions,
                                              [torch.from_numpy(slots) for slots in inp.slot_mappings],
                                              [torch.from_numpy(table) for table in inp.block_tables],
                                              torch.from_numpy(inp.seq_lens))
        dev = self.device
        qsl_cpu = torch.from_numpy(inp.query_start_loc)
        seq_lens_cpu = torch.from_numpy(inp.seq_lens)
        qsl, seq_lens = qsl_cpu.to(dev, non_blocking=True), seq_lens_cpu.to(dev, non_blocking=True)
        # One metadata per KV-cache group (their block ids differ); each layer reads its group's.
        per_group = [self.attn_backend.build_metadata(CommonAttentionMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl_cpu,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens_cpu,
            block_table=torch.from_numpy(block_table).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev, non_blocking=True),
            num_reqs=scheduler_output.num_reqs,
            num_actual_tokens=scheduler_output.total_num_scheduled_tokens,
            max_query_len=inp.max_query_len,
            max_seq_len=inp.max_seq_len,
            block_size=self.block_size,
        )) for block_table, slot_mapping in zip(inp.block_tables, inp.slot_mappings)]
        attn_metadata = per_group[0] if len(per_group) == 1 else per_group
        args = [inp.input_ids.to(dev, non_blocking=True), inp.positions.to(dev, non_blocking=True), attn_metadata]
        if not self.is_first_stage:  # the previous stage's (hidden, residual)
            args.append(self.groups.pp.recv((2, scheduler_output.total_num_scheduled_tokens,
                                             self.model_config.hf_config.hidden_size), self.dtype, device=dev))
        out = self.model(*args)
        if not self.is_last_stage:
            self.groups.pp.send(out)
        return out

    def _sample(self, logits: torch.Tensor, states: list[CachedRequestState], failed: dict[str, str],
                ) -> tuple[list[CachedRequestState], list[int], list[TokenLogprobs | None] | None]:
        """One token (and its logprobs) per row: the rows that sampled, their tokens and logprobs.

        The whole batch samples at once. Should that raise, each row samples alone, from its generator's state
        before the batch's attempt, so that each healthy row gets exactly the token it would have got; a row that
        raises alone fails its request (added to `failed`).
        """
        saved = [None if s.generator is None else s.generator.get_state() for s in states]
        try:
            return (states, *self._sample_rows(logits, states))
        except Exception as e:  # noqa: BLE001 - find the rows at fault
            logger.warning("vx: sampling a batch of %d rows failed (%s: %s); sampling each row alone", len(states),
                           type(e).__name__, e)
        kept: list[CachedRequestState] = []
        sampled: list[int] = []
        row_logprobs: list[TokenLogprobs | None] = []
        for i, state in enumerate(states):
            if saved[i] is not None:
                state.generator.set_state(saved[i])
            try:
                token, logprobs = self._sample_rows(logits[i:i + 1], [state])
            except Exception as e:  # noqa: BLE001 - this request fails alone
                failed[state.req_id] = f"sampling failed: {type(e).__name__}: {e}"
                logger.warning("vx: request %r failed alone: sampling raised %s: %s", state.req_id,
                               type(e).__name__, e)
                continue
            kept.append(state)
            sampled += token
            row_logprobs.append(None if logprobs is None else logprobs[0])
        return kept, sampled, row_logprobs if any(lp is not None for lp in row_logprobs) else None

    def _sample_rows(self, logits: torch.Tensor, states: list[CachedRequestState],
                     ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """Sample the rows of `logits` (row i: `states[i]`): their tokens, and their logprobs if some row asks."""
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        meta = SamplingMetadata.build(
            [s.sampling_params for s in states], generators, self.device,
            output_token_ids=[s.output_token_ids for s in states],
            prompt_token_ids=[s.prompt_token_ids for s in states],
            eos_token_ids=[s.eos_token_ids for s in states],
            bad_words_token_ids=[s.bad_words_token_ids for s in states])
        sampler_output = self.sampler(logits, meta)
        sampled = sampler_output.sampled_token_ids.tolist()
        if sampler_output.logprobs is None:
            return sampled, None
        return sampled, _split_logprobs(sampler_output.logprobs, [s.sampling_params.logprobs for s in states])

    def _prompt_logprobs(self, scheduler_output: SchedulerOutput, query_start_loc: np.ndarray, hidden: torch.Tensor,
                         failed: dict[str, str]) -> dict[str, tuple[int, TokenLogprobs]] | None:
        """Logprobs of the prompt tokens this step computed, for the requests that asked for `prompt_logprobs`.

        The hidden state at prompt position p predicts prompt token p + 1; the last prompt position predicts the
        first output token instead, so it is left out. A request that already generated (resumed after a
        preemption) was served its prompt logprobs before and is skipped. Computed for all those requests at
        once; should that raise, for each alone, and a request whose own computation raises fails (`failed`).
        """
        wanted: list[tuple[str, int, list[int], int, torch.Tensor]] = []  # (req id, first position, targets, k, rows)
        for i, req_id in enumerate(scheduler_output.req_ids):
            state = self.input_batch.states[req_id]
            k = state.sampling_params.prompt_logprobs
            if k is None or state.output_token_ids or req_id in failed:
                continue
            prompt = state.prompt_token_ids
            start = state.num_computed_tokens
            end = min(start + scheduler_output.num_scheduled_tokens[req_id], len(prompt) - 1)
            if end <= start:
                continue
            first_row = int(query_start_loc[i])
            wanted.append((req_id, start, prompt[start + 1:end + 1], k,
                           torch.arange(first_row, first_row + end - start)))
        if not wanted:
            return None
        try:
            return self._gather_prompt_logprobs(hidden, wanted)
        except Exception as e:  # noqa: BLE001 - find the requests at fault
            logger.warning("vx: prompt logprobs of %d requests failed (%s: %s); computing each alone", len(wanted),
                           type(e).__name__, e)
        out: dict[str, tuple[int, TokenLogprobs]] = {}
        for w in wanted:
            try:
                out.update(self._gather_prompt_logprobs(hidden, [w]))
            except Exception as e:  # noqa: BLE001 - this request fails alone
                failed[w[0]] = f"prompt logprobs failed: {type(e).__name__}: {e}"
        return out or None

    def _gather_prompt_logprobs(self, hidden: torch.Tensor, wanted: list[tuple[str, int, list[int], int, torch.Tensor]],
                                ) -> dict[str, tuple[int, TokenLogprobs]]:
        rows = torch.cat([w[4] for w in wanted]).to(self.device)
        logprobs = self.model.compute_logits(hidden[rows]).float().log_softmax(dim=-1)
        targets = torch.tensor([t for w in wanted for t in w[2]], dtype=torch.int64, device=self.device)
        gathered = gather_logprobs(logprobs, targets, max(w[3] for w in wanted))
        ids, lps, ranks = gathered.token_ids.tolist(), gathered.logprobs.tolist(), gathered.ranks.tolist()
        out: dict[str, tuple[int, TokenLogprobs]] = {}
        offset = 0
        for req_id, start, targets_of_req, k, _ in wanted:
            end = offset + len(targets_of_req)
            out[req_id] = (start, _rows_logprobs(ids, lps, ranks, offset, end, k))
            offset = end
        return out


def _split_logprobs(tensors: LogprobsTensors, ks: list[int | None]) -> list[TokenLogprobs | None]:
    """One single-position `TokenLogprobs` per row, cut to that row's own k (None where k is None)."""
    ids, lps, ranks = tensors.token_ids.tolist(), tensors.logprobs.tolist(), tensors.ranks.tolist()
    return [None if k is None else _rows_logprobs(ids, lps, ranks, r, r + 1, k) for r, k in enumerate(ks)]


def _rows_logprobs(ids: list[list[int]], lps: list[list[float]], ranks: list[int], start: int, stop: int,
                   k: int) -> TokenLogprobs:
    """Rows [start, stop) of gathered logprobs as consecutive positions, each cut to the chosen token + top k."""
    return TokenLogprobs(token_ids=[row[:k + 1] for row in ids[start:stop]],
                         logprobs=[row[:k + 1] for row in lps[start:stop]], ranks=ranks[start:stop])
