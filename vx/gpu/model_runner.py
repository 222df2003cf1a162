"""Runs the model for one scheduled step: build inputs, forward, logits for sampling rows, sample."""

from __future__ import annotations

import logging

import numpy as np
import torch

from vx.config import VxConfig
from vx.core.protocol import TokenLogprobs
from vx.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from vx.gpu.attention import get_attn_backend
from vx.gpu.attention.backend import CommonAttentionMetadata
from vx.gpu.grammar_bitmask import apply_grammar_bitmask
from vx.gpu.input_batch import InputBatch
from vx.gpu.kv_cache import bind_kv_caches, bytes_per_block
from vx.gpu.sampler import LogprobsTensors, Sampler, gather_logprobs
from vx.gpu.sampling_metadata import SamplingMetadata
from vx.models.loader import DefaultModelLoader
from vx.platform import torch_dtype

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, its KV cache tensors, the persistent batch state and the sampler."""

    def __init__(self, config: VxConfig, device: torch.device) -> None:
        self.config = config
        self.model_config = config.model_config
        self.device = device
        self.dtype = torch_dtype(config.model_config.dtype)
        self.block_size = config.cache_config.block_size
        self.input_batch = InputBatch(self.block_size, device, config.model_config.seed)
        self.sampler = Sampler()
        self.model: torch.nn.Module | None = None
        self.attn_backend = get_attn_backend(
            config.device_config.attention_backend, device.type, dtype=self.dtype,
            block_size=self.block_size, head_dim=config.model_config.head_dim)
        self.kv_caches: list[torch.Tensor] = []
        # A hook for fault-injection tests: called with the SchedulerOutput before each forward.
        self.pre_execute_hook = None

    def load_model(self) -> None:
        self.model = DefaultModelLoader().load_model(
            self.model_config.model, self.model_config.hf_config, self.dtype, self.device)

    def kv_cache_bytes_per_block(self) -> int:
        return bytes_per_block(self.model_config, self.block_size, self.dtype, self.attn_backend)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        assert self.model is not None, "load_model() first"
        self.kv_caches = bind_kv_caches(self.model, self.attn_backend, num_blocks, self.block_size,
                                        self.dtype, self.device)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Compute the scheduled tokens and sample one token for each request that reached its end."""
        self.input_batch.update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput.empty()
        if self.pre_execute_hook is not None:
            self.pre_execute_hook(so)
        inp = self.input_batch.prepare(so)
        dev = self.device
        qsl_cpu = torch.from_numpy(inp.query_start_loc)
        seq_lens_cpu = torch.from_numpy(inp.seq_lens)
        common = CommonAttentionMetadata(
            query_start_loc=qsl_cpu.to(dev, non_blocking=True),
            query_start_loc_cpu=qsl_cpu,
            seq_lens=seq_lens_cpu.to(dev, non_blocking=True),
            seq_lens_cpu=seq_lens_cpu,
            block_table=torch.from_numpy(inp.block_table).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(inp.slot_mapping).to(dev, non_blocking=True),
            num_reqs=so.num_reqs,
            num_actual_tokens=so.total_num_scheduled_tokens,
            max_query_len=inp.max_query_len,
            max_seq_len=inp.max_seq_len,
            block_size=self.block_size,
        )
        attn_metadata = self.attn_backend.build_metadata(common)
        hidden = self.model(inp.input_ids.to(dev, non_blocking=True),
                            inp.positions.to(dev, non_blocking=True), attn_metadata)
        prompt_logprobs = self._prompt_logprobs(so, inp.query_start_loc, hidden)
        if not inp.sampling_req_ids:
            return ModelRunnerOutput([], [], prompt_logprobs=prompt_logprobs)
        logits = self.model.compute_logits(hidden[inp.logits_indices.to(dev)])
        if so.grammar_bitmask is not None:
            # Before sampling, so greedy and random rows (and the logits processors) see only allowed tokens.
            apply_grammar_bitmask(logits, so.grammar_bitmask, so.grammar_req_ids, inp.sampling_req_ids)
        states = inp.sampling_states
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        meta = SamplingMetadata.build(
            [s.sampling_params for s in states], generators, dev,
            output_token_ids=[s.output_token_ids for s in states],
            prompt_token_ids=[s.prompt_token_ids for s in states],
            eos_token_ids=[s.eos_token_ids for s in states],
            bad_words_token_ids=[s.bad_words_token_ids for s in states])
        sampler_output = self.sampler(logits, meta)
        sampled = sampler_output.sampled_token_ids.tolist()
        self.input_batch.append_sampled(states, sampled)
        row_logprobs = None
        if sampler_output.logprobs is not None:
            row_logprobs = _split_logprobs(sampler_output.logprobs,
                                           [s.sampling_params.logprobs for s in states])
        return ModelRunnerOutput(inp.sampling_req_ids, sampled, row_logprobs, prompt_logprobs)

    def _prompt_logprobs(self, so: SchedulerOutput, query_start_loc: np.ndarray,
                         hidden: torch.Tensor) -> dict[str, tuple[int, TokenLogprobs]] | None:
        """Logprobs of the prompt tokens this step computed, for the requests that asked for `prompt_logprobs`.

        The hidden state at prompt position p predicts prompt token p + 1; the last prompt position predicts the
        first output token instead, so it is left out. A request that already generated (resumed after a
        preemption) was served its prompt logprobs before and is skipped.
        """
        wanted: list[tuple[str, int, list[int], int]] = []  # (req id, first position, targets, k)
        rows: list[torch.Tensor] = []
        for i, sr in enumerate(so.scheduled):
            state = self.input_batch.states[sr.req_id]
            k = state.sampling_params.prompt_logprobs
            if k is None or state.output_token_ids:
                continue
            prompt = state.prompt_token_ids
            start = sr.num_computed_tokens
            end = min(start + len(sr.token_ids), len(prompt) - 1)
            if end <= start:
                continue
            first_row = int(query_start_loc[i])
            rows.append(torch.arange(first_row, first_row + end - start))
            wanted.append((sr.req_id, start, prompt[start + 1:end + 1], k))
        if not wanted:
            return None
        logprobs = self.model.compute_logits(hidden[torch.cat(rows).to(self.device)]).float().log_softmax(dim=-1)
        targets = torch.tensor([t for w in wanted for t in w[2]], dtype=torch.int64, device=self.device)
        gathered = gather_logprobs(logprobs, targets, max(w[3] for w in wanted))
        ids, lps, ranks = gathered.token_ids.tolist(), gathered.logprobs.tolist(), gathered.ranks.tolist()
        out: dict[str, tuple[int, TokenLogprobs]] = {}
        offset = 0
        for req_id, start, targets_of_req, k in wanted:
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
