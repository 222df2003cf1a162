"""The step types cross a process boundary as they are: every field of a scheduler's plan and of a runner's output
survives msgpack, the grammar bitmask (a numpy array) included, and the workers build the same step from the copy."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from vx.cache import KVCacheManager
from vx.config import CacheConfig, SchedulerConfig
from vx.core.request import Request
from vx.core.scheduler import Scheduler
from vx.gpu.input_batch import InputBatch
from vx.pooling_params import PoolingParams
from vx.sampling_params import SamplingParams
from vx.step import (CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput, StepDecoder,
                     TokenLogprobs, encode_step)


def _every_field_set() -> SchedulerOutput:
    new = NewRequestData(req_id="new", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(
        temperature=0.7, top_k=5, seed=-3, max_tokens=9, stop=["x"], logit_bias={4: 1.5}),
        block_ids=[[4, 5]], num_computed_tokens=2, output_token_ids=[9], eos_token_ids=(0, 7),
        bad_words_token_ids=[[3, 4], [5]], pooling_params=PoolingParams(pooling_type="mean", normalize=False,
                                                                          dimensions=8))
    cached = CachedRequestData(req_id="old", num_computed_tokens=17, new_token_ids=[8], new_block_ids=[[6]])
    bitmask = np.array([[-1, 0x0F0F, 7]], dtype=np.int32)
    return SchedulerOutput(scheduled_new_reqs=[new], scheduled_cached_reqs=[cached],
                           num_scheduled_tokens={"new": 2, "old": 1}, total_num_scheduled_tokens=3,
                           finished_req_ids={"gone"}, preempted_req_ids={"paused"}, grammar_req_ids=["new"],
                           grammar_bitmask=bitmask)


def _fields(struct: msgspec.Struct) -> dict:
    return {f: getattr(struct, f) for f in struct.__struct_fields__}


def test_a_scheduler_output_round_trips_every_field():
    plan = _every_field_set()
    # Every field differs from its default, so that a field the encoder dropped would show.
    for struct in (plan, plan.scheduled_new_reqs[0], plan.scheduled_cached_reqs[0]):
        defaults = dict(zip(struct.__struct_fields__[-len(struct.__struct_defaults__):], struct.__struct_defaults__))
        assert all(getattr(struct, f) != d for f, d in defaults.items() if not isinstance(getattr(struct, f),
                                                                                          np.ndarray))
    copy = StepDecoder().scheduler_output(encode_step(plan))
    copy_fields, plan_fields = _fields(copy), _fields(plan)
    bitmask = copy_fields.pop("grammar_bitmask")
    assert bitmask.dtype == np.int32 and bitmask.flags.writeable
    np.testing.assert_array_equal(bitmask, plan_fields.pop("grammar_bitmask"))
    assert copy_fields == plan_fields
    assert copy.req_ids == ["old", "new"] and copy.num_reqs == 2


def test_a_model_runner_output_round_trips_every_field():
    logprobs = TokenLogprobs(token_ids=[[5, 1]], logprobs=[[-0.5, -1.25]], ranks=[1])
    output = ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[5, 6], logprobs=[logprobs, None],
                               prompt_logprobs={"a": (3, logprobs)}, failed={"c": "sampling failed: boom"},
                               pooled={"d": [0.25, -0.5, 1.0]})
    assert StepDecoder().model_runner_output(encode_step(output)) == output
    assert StepDecoder().model_runner_output(encode_step(ModelRunnerOutput.empty())) == ModelRunnerOutput.empty()


def test_an_object_the_step_types_do_not_expect_is_refused():
    with pytest.raises(TypeError, match="cannot encode"):
        encode_step(ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[object()]))  # type: ignore[list-item]


def test_workers_build_the_same_steps_from_the_decoded_plans():
    """A scheduler's real plans (prefill chunks, decode, preemption and resumption) sent through msgpack give a
    worker the same inputs, step by step, as the plans handed over in-process."""
    block_size = 4
    kv = KVCacheManager(12, block_size, True)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10),
                          CacheConfig(block_size=block_size), kv, max_model_len=64)
    for i in range(3):
        scheduler.add_request(Request(f"r{i}", [10 + i] * (7 + 3 * i), SamplingParams(max_tokens=8, seed=i),
                                      eos_token_ids=[0]))
    direct, remote, decoder = InputBatch(block_size, torch.device("cpu")), InputBatch(block_size, torch.device(
        "cpu")), StepDecoder()
    steps = preempted = 0
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        copy = decoder.scheduler_output(encode_step(plan))
        preempted += len(plan.preempted_req_ids)
        assert direct.update_states(plan) == remote.update_states(copy) == {}
        if plan.total_num_scheduled_tokens:
            a, b = direct.prepare(plan), remote.prepare(copy)
            for name in ("input_ids", "positions", "logits_indices"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
            for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
            assert a.sampling_req_ids == b.sampling_req_ids
            sampled = a.sampling_req_ids
        else:
            sampled = []
        scheduler.update_from_output(plan, ModelRunnerOutput(sampled, [1 + steps % 5] * len(sampled)))
        steps += 1
        assert steps < 200
    assert preempted > 0  # the cache is small enough that the plans include preemption and resumption
