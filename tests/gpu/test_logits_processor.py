"""Logits processors (penalties, logit bias, min tokens, bad words) equal Hugging Face's on a mixed batch, and
change greedy generation end to end exactly as HF `generate` does."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation import logits_process as hf

import vx
from vx.gpu.logits_processor import (
    BadWordsLogitsProcessor,
    FrequencyPresencePenaltyLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinTokensLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    build_logits_processors,
)
from vx.gpu.sampler import Sampler
from vx.gpu.sampling_metadata import SamplingMetadata
from vx.sampling_params import SamplingParams

CPU = torch.device("cpu")
V = 50
TOL = dict(atol=1e-4, rtol=1e-4)
SP = SamplingParams


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g, dtype=torch.float32) * 3.0  # both signs, for repetition penalty


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(V) for _ in range(n)]


def _hf_row(proc, input_ids: list[int], row: torch.Tensor) -> torch.Tensor:
    return proc(torch.tensor([input_ids], dtype=torch.long), row.unsqueeze(0).clone())[0]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # -inf must sit at the same places; the finite values must agree within 1e-4.
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], **TOL)


# A batch of 5 rows, each with its prompt and output so far (repeats included).
PROMPTS = [_tokens(1, 12), _tokens(2, 5), _tokens(3, 20) + [7, 7, 7], _tokens(4, 1), _tokens(5, 9)]
OUTPUTS = [_tokens(11, 6) + [3, 3], [], _tokens(13, 2), _tokens(14, 15), [4]]


def test_repetition_penalty_matches_hf():
    params = [SP(repetition_penalty=1.3), SP(), SP(repetition_penalty=0.7), SP(repetition_penalty=2.0),
              SP(temperature=0.0, repetition_penalty=1.1)]
    logits = _logits(5)
    got = RepetitionPenaltyLogitsProcessor(params, PROMPTS, OUTPUTS).apply(logits.clone())
    for i, p in enumerate(params):
        want = logits[i]
        if p.repetition_penalty != 1.0:
            want = _hf_row(hf.RepetitionPenaltyLogitsProcessor(p.repetition_penalty), PROMPTS[i] + OUTPUTS[i],
                           logits[i])
        _close(got[i], want)
    assert not torch.equal(got[0], logits[0]) and torch.equal(got[1], logits[1])


def test_min_tokens_matches_hf():
    eos = [(0,), (0,), (0, 1), (0,), (0,)]
    params = [
        SP(min_tokens=10, stop_token_ids=[5, 7]),  # 8 generated < 10: eos, 5 and 7 banned
        SP(min_tokens=3),  # nothing generated: eos banned
        SP(min_tokens=2, stop_token_ids=[9]),  # 2 generated: already satisfied
        SP(min_tokens=16, ignore_eos=True, stop_token_ids=[9]),  # eos does not stop, so only 9 is banned
        SP(),
    ]
    logits = _logits(5, seed=1)
    got = MinTokensLogitsProcessor(params, OUTPUTS, eos).apply(logits.clone())
    for i, p in enumerate(params):
        stop = list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(eos[i]))
        want = _hf_row(hf.MinNewTokensLengthLogitsProcessor(len(PROMPTS[i]), p.min_tokens, stop),
                       PROMPTS[i] + OUTPUTS[i], logits[i])
        _close(got[i], want)
    assert torch.isneginf(got[0, [0, 5, 7]]).all() and torch.isneginf(got[1, 0])
    assert torch.isneginf(got).sum().item() == 3 + 1 + 0 + 1 + 0


def test_bad_words_match_hf():
    outs = [[1, 2, 4], [6, 7], [9, 6], [3], [4, 2]]
    words = [[3], [4, 5], [6, 7, 8], [2, 4, 10]]
    bad = [words, words, words, None, [[4, 11]]]
    logits = _logits(5, seed=2)
    got = BadWordsLogitsProcessor(bad, outs).apply(logits.clone())
    for i in range(5):
        want = logits[i]
        if bad[i]:
            # vLLM (and so vx) matches on the generated tokens: they are HF's input_ids here.
            want = _hf_row(hf.NoBadWordsLogitsProcessor(bad[i]), outs[i], logits[i])
        _close(got[i], want)
    banned = {i: torch.isneginf(got[i]).nonzero().flatten().tolist() for i in range(5)}
    assert banned == {0: [3, 5, 10], 1: [3, 8], 2: [3], 3: [], 4: []}


def test_logit_bias_matches_hf():
    params = [SP(logit_bias={3: 5.0, 10: -100.0}), SP(), SP(logit_bias={0: 0.25}), SP(logit_bias={49: -2.5}), SP()]
    logits = _logits(5, seed=3)
    got = LogitBiasLogitsProcessor(params).apply(logits.clone())
    for i, p in enumerate(params):
        want = logits[i]
        if p.logit_bias:
            proc = hf.SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias.items()])
            want = _hf_row(proc, PROMPTS[i] + OUTPUTS[i], logits[i])
        _close(got[i], want)


def _ref_frequency_presence(logits: torch.Tensor, params, outputs) -> torch.Tensor:
    want = logits.clone()
    for i, (p, out) in enumerate(zip(params, outputs)):
        for t in set(out):
            want[i, t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return want


def test_frequency_presence_penalties_match_reference():
    params = [SP(frequency_penalty=0.5), SP(presence_penalty=1.5), SP(), SP(frequency_penalty=-0.3,
              presence_penalty=0.8), SP(frequency_penalty=2.0, repetition_penalty=1.0)]
    logits = _logits(5, seed=4)
    got = FrequencyPresencePenaltyLogitsProcessor(params, OUTPUTS).apply(logits.clone())
    _close(got, _ref_frequency_presence(logits, params, OUTPUTS))
    assert torch.equal(got[2], logits[2])
    # Prompt tokens do not count: row 1 has no output, so presence changes nothing there.
    assert torch.equal(got[1], logits[1])


def test_chain_applies_everything_in_vllm_order_and_drives_greedy():
    eos = [(0,)] * 5
    bad = [[[3], [4, 5]], None, None, [[2, 4]], None]
    params = [
        SP(temperature=0.0, repetition_penalty=1.5, min_tokens=9, logit_bias={8: 3.0}),
        SP(temperature=0.0),
        SP(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5),
        SP(temperature=0.0, bad_words=["x"], logit_bias={1: -1.0}, repetition_penalty=0.8),
        SP(temperature=0.0, min_tokens=1),
    ]
    logits = _logits(5, seed=5)
    md = SamplingMetadata.build(params, {}, CPU, output_token_ids=OUTPUTS, prompt_token_ids=PROMPTS,
                                eos_token_ids=eos, bad_words_token_ids=bad)
    assert md.logits_processors is not None and md.all_greedy
    before = logits.clone()
    sampled = Sampler()(logits, md).sampled_token_ids
    assert torch.equal(logits, before), "the sampler must not modify the caller's logits"

    want = logits.clone()
    for i, p in enumerate(params):
        row, ids = want[i], PROMPTS[i] + OUTPUTS[i]
        if bad[i]:
            row = _hf_row(hf.NoBadWordsLogitsProcessor(bad[i]), OUTPUTS[i] or [0], row)
        if p.min_tokens:
            row = _hf_row(hf.MinNewTokensLengthLogitsProcessor(len(PROMPTS[i]), p.min_tokens, list(eos[i])), ids, row)
        if p.logit_bias:
            row = _hf_row(hf.SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias.items()]), ids, row)
        if p.repetition_penalty != 1.0:
            row = _hf_row(hf.RepetitionPenaltyLogitsProcessor(p.repetition_penalty), ids, row)
        want[i] = row
    want = _ref_frequency_presence(want, params, OUTPUTS)
    _close(md.logits_processors(logits.clone()), want)
    assert sampled.tolist() == want.argmax(dim=-1).tolist()
    assert sampled[1].item() == logits[1].argmax().item()  # an untouched row keeps its raw argmax


def test_fast_path_builds_nothing():
    plain = [SP(), SP(temperature=0.0), SP(top_k=5, top_p=0.9, seed=3)]
    assert build_logits_processors(plain, [[1, 2], [], [3]]) is None
    assert SamplingMetadata.build(plain, {}, CPU, output_token_ids=[[1, 2], [], [3]]).logits_processors is None
    assert SamplingMetadata.build(plain, {}, CPU).logits_processors is None
    # min_tokens already reached: nothing left to do this step.
    assert build_logits_processors([SP(min_tokens=2)], [[5, 6]], eos_token_ids=[(0,)]) is None
    assert build_logits_processors([SP(min_tokens=3)], [[5, 6]], eos_token_ids=[(0,)]) is not None


# ---------------------------------------------------------------------------------------------- end to end
E2E_PROMPTS = [[5, 9, 17, 5, 9, 17, 33], [100, 101, 102], list(range(40, 70)), [7]]
MAX_NEW = 16


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _hf_generate(model, prompt: list[int], **kwargs) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = vx.LLM(tiny_model_dir, dtype="float32", device="cpu")
    yield engine
    engine.shutdown()


ENGINE_CONFIGS = {
    "default": {},
    "chunked16": {"max_num_batched_tokens": 16},  # prompts arrive in chunks
    "tiny_kv_preempt": {"num_kv_blocks": 10, "block_size": 8, "max_model_len": 64},  # requests resume mid-output
}


@pytest.mark.parametrize("config_name", list(ENGINE_CONFIGS))
def test_greedy_repetition_penalty_equals_hf(request, hf_model, tiny_model_dir, config_name):
    if config_name == "default":
        llm = request.getfixturevalue("llm")
    else:
        llm = vx.LLM(tiny_model_dir, dtype="float32", device="cpu", **ENGINE_CONFIGS[config_name])
        request.addfinalizer(llm.shutdown)
    pen = SP(temperature=0.0, max_tokens=MAX_NEW, repetition_penalty=1.3)
    plain = SP(temperature=0.0, max_tokens=MAX_NEW)
    # Penalised and plain requests share the batch; each must match its own HF run.
    params = [pen, plain, pen, plain] + [plain, pen, plain, pen]
    outs = llm.generate(E2E_PROMPTS + E2E_PROMPTS, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    want_pen = [_hf_generate(hf_model, p, repetition_penalty=1.3) for p in E2E_PROMPTS]
    want_plain = [_hf_generate(hf_model, p) for p in E2E_PROMPTS]
    for i, p in enumerate(params):
        want = (want_pen if p is pen else want_plain)[i % len(E2E_PROMPTS)]
        assert list(got[i]) == want, f"request {i} (repetition_penalty={p.repetition_penalty})"
    assert any(a != b for a, b in zip(want_pen, want_plain)), "the penalty should change some greedy output"
    if config_name == "tiny_kv_preempt":
        assert llm.stats().num_preemptions > 0, "the KV cache was meant to be too small to avoid preemption"


def test_min_tokens_delays_a_stop_token(llm, hf_model):
    prompt = E2E_PROMPTS[0]
    base = SP(temperature=0.0, max_tokens=MAX_NEW)
    free = list(llm.generate([prompt], base, use_tqdm=False)[0].outputs[0].token_ids)
    stop = free[1]  # a stop token the unconstrained request meets at its 2nd step (or earlier)
    early = llm.generate([prompt], base.clone(stop_token_ids=[stop]), use_tqdm=False)[0].outputs[0]
    assert len(early.token_ids) <= 2 and early.finish_reason == "stop"

    min_tokens = 8
    late = llm.generate([prompt], base.clone(stop_token_ids=[stop], min_tokens=min_tokens),
                        use_tqdm=False)[0].outputs[0]
    ids = list(late.token_ids)
    assert len(ids) >= min_tokens and stop not in ids[:min_tokens] and 0 not in ids[:min_tokens]
    # HF: min_new_tokens bans every eos id (here eos 0 and the stop token) for the first min_tokens steps.
    want = _hf_generate(hf_model, prompt, min_new_tokens=min_tokens, eos_token_id=[0, stop])
    assert ids == want


def test_bad_words_and_logit_bias_reach_the_engine(llm):
    tok = llm.tokenizer
    plain, spaced = tok.encode("is", add_special_tokens=False), tok.encode(" is", add_special_tokens=False)
    assert len(plain) == len(spaced) == 1 and plain != spaced  # so "is" bans both spellings
    bias = {plain[0]: 100.0, spaced[0]: 100.0}
    base = SP(temperature=0.0, max_tokens=MAX_NEW, logit_bias=bias)
    pushed = llm.generate([E2E_PROMPTS[1]], base, use_tqdm=False)[0].outputs[0].token_ids
    assert set(pushed) <= set(bias), "a +100 bias makes these two tokens the greedy picks"
    banned = llm.generate([E2E_PROMPTS[1]], base.clone(bad_words=["is"]), use_tqdm=False)[0].outputs[0].token_ids
    assert not set(banned) & set(bias), "bad words beat any bias: both spellings of 'is' are banned"
