"""InputBatch: the runner's copy of each live request, kept up to date from the step plans, and one step's inputs
flattened from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vx.gpu.input_batch as input_batch_module
from vx.gpu.input_batch import InputBatch
from vx.sampling_params import SamplingParams
from vx.step import CachedRequestData, NewRequestData, SchedulerOutput

BS = 4
CPU = torch.device("cpu")


def plan(new=(), cached=(), finished=(), preempted=()) -> SchedulerOutput:
    """A step plan; each entry is (request data, tokens to compute now)."""
    num = {data.req_id: n for data, n in (*new, *cached)}
    return SchedulerOutput(scheduled_new_reqs=[d for d, _ in new], scheduled_cached_reqs=[d for d, _ in cached],
                           num_scheduled_tokens=num, total_num_scheduled_tokens=sum(num.values()),
                           finished_req_ids=set(finished), preempted_req_ids=set(preempted))


def new_req(req_id, prompt, blocks, computed=0, output=(), seed=None) -> NewRequestData:
    return NewRequestData(req_id=req_id, prompt_token_ids=list(prompt), sampling_params=SamplingParams(seed=seed),
                          block_ids=[list(blocks)], num_computed_tokens=computed, output_token_ids=list(output))


def test_a_chunked_prefill_then_decode_flattens_tokens_positions_and_slots():
    batch = InputBatch(BS, CPU)
    prompt = list(range(100, 106))  # 6 tokens: a chunk of 4, then 2 and the first sample
    p = plan(new=[(new_req("a", prompt, [7, 3]), 4)])
    assert batch.update_states(p) == {}
    step = batch.prepare(p)
    assert step.input_ids.tolist() == prompt[:4] and step.positions.tolist() == [0, 1, 2, 3]
    assert step.slot_mapping.tolist() == [28, 29, 30, 31]  # block 7's slots
    assert step.sampling_req_ids == [] and step.logits_indices.tolist() == []  # mid-prompt: no sample

    p = plan(cached=[(CachedRequestData(req_id="a", num_computed_tokens=4), 2)])
    batch.update_states(p)
    step = batch.prepare(p)
    assert step.input_ids.tolist() == prompt[4:] and step.positions.tolist() == [4, 5]
    assert step.slot_mapping.tolist() == [12, 13]  # block 3's first slots
    assert step.sampling_req_ids == ["a"] and step.logits_indices.tolist() == [1]
    assert step.seq_lens.tolist() == [6] and step.query_start_loc.tolist() == [0, 2]

    # Decode: the token sampled last step arrives with the plan, with a new block.
    p = plan(cached=[(CachedRequestData(req_id="a", num_computed_tokens=6, new_token_ids=[55],
                                        new_block_ids=[[9]]), 1)])
    batch.update_states(p)
    step = batch.prepare(p)
    assert step.input_ids.tolist() == [55] and step.positions.tolist() == [6] and step.slot_mapping.tolist() == [14]
    assert batch.states["a"].block_ids == [[7, 3, 9]] and batch.states["a"].output_token_ids == [55]
    assert step.sampling_states[0].output_token_ids == [55]  # what the penalties see


def test_a_batch_of_cached_then_new_requests_pads_the_block_table():
    batch = InputBatch(BS, CPU)
    batch.update_states(plan(new=[(new_req("old", [1, 2, 3], [5]), 3)]))
    p = plan(new=[(new_req("new", list(range(10, 19)), [1, 2, 4]), 9)],
             cached=[(CachedRequestData(req_id="old", num_computed_tokens=3, new_token_ids=[8]), 1)])
    batch.update_states(p)
    step = batch.prepare(p)
    assert step.input_ids.tolist() == [8, *range(10, 19)]
    assert step.query_start_loc.tolist() == [0, 1, 10] and step.seq_lens.tolist() == [4, 9]
    np.testing.assert_array_equal(step.block_table, [[5, 0, 0], [1, 2, 4]])
    assert step.sampling_req_ids == ["old", "new"] and step.logits_indices.tolist() == [0, 9]
    assert step.max_query_len == 9 and step.max_seq_len == 9


def test_a_resumed_request_recomputes_across_its_prompt_and_output():
    """Resumed after preemption with part of its prompt cached: the tokens to compute run from inside the prompt
    into its output, and it samples after its last output token."""
    batch = InputBatch(BS, CPU)
    p = plan(new=[(new_req("a", [1, 2, 3, 4, 5, 6], [3, 4, 5], computed=4, output=[70, 71]), 4)])
    batch.update_states(p)
    step = batch.prepare(p)
    assert step.input_ids.tolist() == [5, 6, 70, 71] and step.positions.tolist() == [4, 5, 6, 7]
    assert step.sampling_req_ids == ["a"]


def test_preemption_parks_the_generator_and_resumption_draws_on_from_it():
    batch = InputBatch(BS, CPU)
    batch.update_states(plan(new=[(new_req("a", [1, 2], [1], seed=5), 2)]))
    generator = batch.states["a"].generator
    first = torch.rand(1, generator=generator)
    batch.update_states(plan(preempted=["a"]))
    assert "a" not in batch.states and batch.parked_generators["a"] is generator
    batch.update_states(plan(new=[(new_req("a", [1, 2], [2], output=[9], seed=5), 3)]))
    assert batch.states["a"].generator is generator and not batch.parked_generators
    assert not torch.equal(torch.rand(1, generator=generator), first)  # it went on, it did not start over
    batch.update_states(plan(finished=["a"]))
    assert not batch.states and not batch.parked_generators


def test_a_request_preempted_and_resumed_in_one_step_keeps_its_generator():
    batch = InputBatch(BS, CPU)
    batch.update_states(plan(new=[(new_req("a", [1, 2], [1], seed=5), 2)]))
    generator = batch.states["a"].generator
    batch.update_states(plan(new=[(new_req("a", [1, 2], [2], output=[9], seed=5), 3)]))
    assert batch.states["a"].generator is generator and batch.states["a"].block_ids == [[2]]


def test_an_unseeded_request_has_no_generator_and_a_seeded_one_its_own():
    batch = InputBatch(BS, CPU)
    batch.update_states(plan(new=[(new_req("free", [1], [1]), 1), (new_req("seeded", [1], [2], seed=3), 1)]))
    assert batch.states["free"].generator is None
    expected = torch.rand(4, generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch.rand(4, generator=batch.states["seeded"].generator), expected)


def test_a_request_whose_generator_fails_is_registered_and_reported(monkeypatch):
    def failing(seed, device):
        raise RuntimeError("no generator")

    monkeypatch.setattr(input_batch_module, "make_generator", failing)
    batch = InputBatch(BS, CPU)
    p = plan(new=[(new_req("a", [1, 2], [1], seed=1), 2)])
    assert batch.update_states(p) == {"a": "preparing its sampling failed: RuntimeError: no generator"}
    assert batch.prepare(p).input_ids.tolist() == [1, 2]  # it still runs in the forward pass


@pytest.mark.parametrize("start,count", [(0, 3), (2, 4), (4, 2), (5, 1), (0, 6)])
def test_token_ids_slice_across_prompt_and_output(start, count):
    batch = InputBatch(BS, CPU)
    batch.update_states(plan(new=[(new_req("a", [1, 2, 3, 4], [1, 2], output=[5, 6]), 6)]))
    assert batch.states["a"].token_ids(start, count) == [1, 2, 3, 4, 5, 6][start:start + count]
