"""One request cannot hurt the others: inside the engine, a failure that belongs to one request (its sampling state,
its sampling, its prompt logprobs, its grammar's compile) fails that request alone, with its own error, while the
requests beside it in the same steps get exactly the tokens they get alone; and random hostile input (Hypothesis)
never takes the engine down. In-process engine, tiny random Qwen3, CPU."""

from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import vx
from vx.errors import EngineGenerateError, InvalidRequestError
import vx.gpu.input_batch as input_batch_module
from vx.gpu.sampler import Sampler
from vx.sampling_params import StructuredOutputsParams as SO

VOCAB = 512
MAX_N = 4
ENGINE_KWARGS = dict(dtype="float32", device="cpu", max_model_len=64, num_kv_blocks=96, block_size=16,
                     max_n_sequences=MAX_N, grammar_compile_timeout_s=0.25)
HEALTHY = vx.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
HEALTHY_PROMPTS = ["The capital of France is", [5, 6, 7, 8, 9, 10, 11]]
POISON_TEMPERATURE = 0.625  # the marker PoisonSampler fails on


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = vx.LLM(tiny_model_dir, **ENGINE_KWARGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(llm):
    """The healthy requests' tokens when each runs alone."""
    return [llm.generate([p], HEALTHY, use_tqdm=False)[0].outputs[0].token_ids for p in HEALTHY_PROMPTS]


def runner(llm: vx.LLM):
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner


def run(llm: vx.LLM, requests: dict[str, tuple]) -> tuple[dict[str, vx.RequestOutput], list[Exception]]:
    """Queue (prompt, params) by id and step to the end: the final outputs by id, and what the steps raised."""
    engine = llm.llm_engine
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    finals, errors = {}, []
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except EngineGenerateError as e:
            errors.append(e)
            continue
        finals.update((o.request_id, o) for o in outs if o.finished)
    return finals, errors


def alone(llm: vx.LLM, prompt, params) -> vx.CompletionOutput:
    return run(llm, {"alone": (prompt, params)})[0]["alone"].outputs[0]


def assert_idle(llm: vx.LLM) -> None:
    stats = llm.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_in_use) == (0, 0, 0), stats
    assert not llm.llm_engine.has_unfinished_requests()


class PoisonSampler(Sampler):
    """A test-only sampler that raises for any batch holding a row of temperature POISON_TEMPERATURE."""

    def forward(self, logits, metadata):
        if bool(((metadata.temperature - POISON_TEMPERATURE).abs() < 1e-6).any()):
            raise RuntimeError("injected sampling failure")
        return super().forward(logits, metadata)


# Requests that share the steps with the one that fails: greedy, seeded, with logprobs and penalties.
NEIGHBOURS = {
    "greedy": (HEALTHY_PROMPTS[0], HEALTHY.clone(logprobs=3)),
    "seeded": (HEALTHY_PROMPTS[1], vx.SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True,
                                                     logprobs=2, repetition_penalty=1.2)),
    "unseeded-greedy-penalized": ([3, 4, 5], vx.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                               frequency_penalty=1.0, logit_bias={7: 5.0})),
}


def assert_same_logprobs(got, want) -> None:
    """Same tokens and ranks at every position; the values agree to float32 rounding (the batch's shape differs)."""
    assert (got is None) == (want is None)
    for g, w in zip(got or [], want or []):
        assert list(g) == list(w) and [x.rank for x in g.values()] == [x.rank for x in w.values()]
        assert [x.logprob for x in g.values()] == pytest.approx([x.logprob for x in w.values()], abs=1e-5)


def assert_neighbours_as_alone(llm: vx.LLM, finals: dict[str, vx.RequestOutput]) -> None:
    for rid, (prompt, params) in NEIGHBOURS.items():
        want, got = alone(llm, prompt, params), finals[rid].outputs[0]
        assert got.token_ids == want.token_ids, rid
        assert_same_logprobs(got.logprobs, want.logprobs)


def test_a_sampling_failure_fails_only_its_request(llm, monkeypatch):
    """The batch's sampling raises because of one row: that request fails (an internal error, not the caller's
    input), and the rows beside it, sampled alone from their generators' states, get the tokens they get alone."""
    monkeypatch.setattr(runner(llm), "sampler", PoisonSampler())
    poisoned = vx.SamplingParams(temperature=POISON_TEMPERATURE, max_tokens=8)
    finals, errors = run(llm, {**NEIGHBOURS, "poisoned": ("hello", poisoned)})
    assert len(errors) == 1 and not isinstance(errors[0], InvalidRequestError)
    assert str(errors[0]) == ("Request 'poisoned' failed in the engine: sampling failed: RuntimeError: injected "
                              "sampling failure")
    assert sorted(finals) == sorted(NEIGHBOURS)
    assert_neighbours_as_alone(llm, finals)
    assert_idle(llm)


def test_a_failure_preparing_a_request_fails_only_it(llm, monkeypatch):
    """A new request whose sampling state cannot be prepared fails alone; its prompt still runs in the step's
    forward pass (its blocks may be shared), and the others are untouched."""
    make = input_batch_module.make_generator

    def failing(seed, device):
        if seed == 666:
            raise RuntimeError("injected generator failure")
        return make(seed, device)

    monkeypatch.setattr(input_batch_module, "make_generator", failing)
    # Same prompt as "greedy": it shares that request's prefix blocks in the same step.
    bad = (HEALTHY_PROMPTS[0], vx.SamplingParams(temperature=1.0, seed=666, max_tokens=8))
    finals, errors = run(llm, {"bad": bad, **NEIGHBOURS})
    assert [str(e) for e in errors] == ["Request 'bad' failed in the engine: preparing its sampling failed: "
                                        "RuntimeError: injected generator failure"]
    assert_neighbours_as_alone(llm, finals)
    assert_idle(llm)


def test_a_prompt_logprobs_failure_fails_only_its_request(llm, monkeypatch):
    r = runner(llm)
    gather = r._gather_prompt_logprobs

    def failing(hidden, wanted):
        if any(w[3] == 7 for w in wanted):
            raise RuntimeError("injected prompt logprobs failure")
        return gather(hidden, wanted)

    monkeypatch.setattr(r, "_gather_prompt_logprobs", failing)
    good = (HEALTHY_PROMPTS[1], HEALTHY.clone(prompt_logprobs=2))
    finals, errors = run(llm, {"good": good, "bad": ([9, 8, 7, 6], HEALTHY.clone(prompt_logprobs=7))})
    assert [str(e) for e in errors] == ["Request 'bad' failed in the engine: prompt logprobs failed: RuntimeError: "
                                        "injected prompt logprobs failure"]
    out = alone(llm, *good)
    assert finals["good"].outputs[0].token_ids == out.token_ids
    assert_same_logprobs(finals["good"].prompt_logprobs[1:], run(llm, {"again": good})[0]["again"].prompt_logprobs[1:])
    assert_idle(llm)


def test_a_grammar_that_compiles_too_long_fails_only_its_request(llm, reference):
    """A schema that takes longer than grammar_compile_timeout_s (0.25 s here) to compile fails its request as the
    caller's fault (a ValueError), while a greedy request and a small constrained one beside it are served."""
    rng = random.Random(0)
    slow = {"enum": ["".join(rng.choice("abcdefghij") for _ in range(100)) for _ in range(1000)]}  # ~0.5 s, 101 KiB
    small = vx.SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=SO(regex=r"[0-9]{3}"))
    finals, errors = run(llm, {"slow": ("hi", vx.SamplingParams(max_tokens=4, structured_outputs=SO(json=slow))),
                               "healthy": (HEALTHY_PROMPTS[0], HEALTHY), "small": ("hi", small)})
    assert len(errors) == 1 and isinstance(errors[0], InvalidRequestError)
    assert str(errors[0]).startswith("The engine refused request 'slow': structured_outputs.json is too costly to "
                                     "compile: compiling took longer than 0.25 s")
    assert finals["healthy"].outputs[0].token_ids == reference[0]
    assert len(finals["small"].outputs[0].text) == 3
    assert_idle(llm)


# ------------------------------------------------------------------------------------------------ Hypothesis
HUGE = [2**31, 2**62, 2**63 - 1, 2**63, 2**64, 10**20, -(2**63) - 1]
huge = st.sampled_from(HUGE)
nonfinite = st.sampled_from([float("nan"), float("inf"), float("-inf")])
short_text = st.text(max_size=8)


def mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy) -> st.SearchStrategy:
    """Valid four times in five: most requests reach the engine, with edge values, and some do not."""
    return st.one_of(valid, valid, valid, valid, invalid)


VALID_REGEXES = [r"[0-9]{3}", r"(yes|no)", r"[a-z]+@[a-z]+\.com", r"\d{1,2}-\d{1,2}", r"a*b?c{2,4}"]
BAD_REGEXES = ["[0-9", "(", "a{3,1}", "*", "\\", "(?<=a)b"]
VALID_GRAMMARS = ['root ::= "a" | "b"', 'root ::= [0-9]+ "." [0-9]', 'root ::= x x\nx ::= "ab" | "c"']
BAD_GRAMMARS = ["root ::=", "root ::= undefined", 'x ::= "a"', "root ::= [", "::="]
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=4))
json_keys = st.one_of(st.sampled_from(["type", "properties", "enum", "items", "minimum", "maximum", "maxLength",
                                       "minLength", "pattern", "required", "anyOf", "const", "$ref",
                                       "additionalProperties", "minItems", "maxItems"]), st.text(max_size=4))
json_values = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                              st.dictionaries(json_keys, inner, max_size=4)),
                           max_leaves=12)
schemas = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "object", "array",
                                                    "null", "nonsense"])}),
    st.dictionaries(json_keys, json_values, max_size=4),
    st.builds(lambda n: {"type": "object", "properties": {"k": {"enum": [f"v{i}" for i in range(n)]}}},
              st.integers(1, 50)),
)
regexes = st.one_of(st.sampled_from(VALID_REGEXES + BAD_REGEXES), st.text(min_size=1, max_size=8))
grammars = st.one_of(st.sampled_from(VALID_GRAMMARS + BAD_GRAMMARS), st.text(min_size=1, max_size=8))
constraints = st.one_of(  # anything, valid or not
    st.builds(lambda r: {"regex": r}, regexes),
    st.builds(lambda g: {"grammar": g}, grammars),
    st.builds(lambda j: {"json": j}, st.one_of(schemas, st.builds(json.dumps, schemas), short_text)),
    st.builds(lambda c: {"choice": c}, mostly(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=4),
                                              st.lists(short_text, max_size=3))),
    st.just({"json_object": True}),
    st.builds(lambda: {"regex": "a" * (200 * 1024)}),  # over the size limit
)
token_ids = st.integers(0, VOCAB - 1)
bad_token_ids = st.one_of(st.integers(VOCAB, VOCAB + 100), st.integers(-5, -1), huge)
# field -> (valid values, edge values included; values the front end or the engine must refuse)
FIELDS = {
    "n": (st.integers(1, MAX_N), st.one_of(st.integers(-1, 0), st.just(MAX_N + 1), huge)),
    "temperature": (st.floats(0, 2), st.one_of(nonfinite, st.just(-1.0))),
    "top_p": (st.floats(0.01, 1.0), st.one_of(nonfinite, st.sampled_from([0.0, 1.5]))),
    "top_k": (st.one_of(st.integers(-1, VOCAB), st.integers(0, 3)), st.one_of(st.just(VOCAB + 1), huge)),
    "min_p": (st.floats(0, 1), st.one_of(nonfinite, st.just(1.5))),
    "seed": (st.integers(-(2**63), 2**63 - 1), huge),
    "max_tokens": (st.one_of(st.none(), st.integers(1, 12)), st.one_of(st.integers(-1, 0), huge)),
    "min_tokens": (st.integers(0, 4), huge),
    "logprobs": (st.integers(0, 20), st.one_of(st.just(21), huge)),
    "prompt_logprobs": (st.integers(0, 20), st.one_of(st.just(21), huge)),
    "priority": (st.integers(-(2**31), 2**31 - 1), huge),
    "stop": (st.lists(st.text(min_size=1, max_size=8), max_size=3), st.sampled_from([[""], ["x"] * 100])),
    "stop_token_ids": (st.lists(token_ids, max_size=3), st.lists(bad_token_ids, min_size=1, max_size=2)),
    "logit_bias": (st.dictionaries(token_ids, st.floats(-100, 100), max_size=3),
                   st.one_of(st.dictionaries(bad_token_ids, st.floats(-100, 100), min_size=1, max_size=2),
                             st.dictionaries(token_ids, st.one_of(nonfinite, st.just(150.0)), min_size=1))),
    "bad_words": (st.lists(short_text, max_size=3), st.just(["x" * 2000])),
    "presence_penalty": (st.floats(-2, 2), st.one_of(nonfinite, st.just(3.0))),
    "frequency_penalty": (st.floats(-2, 2), st.one_of(nonfinite, st.just(-3.0))),
    "repetition_penalty": (st.floats(0.1, 2), st.one_of(nonfinite, st.just(0.0))),
    "ignore_eos": (st.booleans(), st.booleans()),
}


def _consistent(fields: dict) -> dict:
    """Valid fields that are valid together too: min_tokens <= max_tokens."""
    if fields.get("max_tokens") is not None and fields.get("min_tokens", 0) > fields["max_tokens"]:
        fields["min_tokens"] = fields["max_tokens"]
    return fields


valid_fields = st.builds(_consistent, st.fixed_dictionaries({}, optional={k: v for k, (v, _) in FIELDS.items()}))
any_fields = st.fixed_dictionaries({}, optional={k: mostly(v, bad) for k, (v, bad) in FIELDS.items()})
# A character may take 4 byte-level tokens: 15 characters always fit max_model_len=64 with one token to generate.
valid_prompts = st.one_of(st.text(min_size=1, max_size=15), st.lists(token_ids, min_size=1, max_size=60))
prompts = mostly(valid_prompts,
                 st.one_of(st.just(""), st.lists(bad_token_ids, min_size=1, max_size=3), st.just([1] * 70)))
# Constraints that pass the front end's checks but that xgrammar refuses (or, for a random schema, may accept).
engine_refused = st.one_of(st.builds(lambda r: {"regex": r}, st.sampled_from(BAD_REGEXES)),
                           st.builds(lambda g: {"grammar": g}, st.sampled_from(BAD_GRAMMARS)),
                           st.builds(lambda j: {"json": j}, st.dictionaries(json_keys, json_values, min_size=1,
                                                                           max_size=4)))
served = st.one_of(st.none(), st.builds(lambda r: {"regex": r}, st.sampled_from(VALID_REGEXES)),
                   st.builds(lambda g: {"grammar": g}, st.sampled_from(VALID_GRAMMARS)),
                   st.just({"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}),
                   st.builds(lambda c: {"choice": c}, st.lists(st.text(min_size=1, max_size=6), min_size=1,
                                                               max_size=4)))


def _request(kind: str, fields: st.SearchStrategy, constraint: st.SearchStrategy,
             prompt: st.SearchStrategy = valid_prompts) -> st.SearchStrategy:
    """(kind, prompt, SamplingParams keyword arguments)."""
    return st.builds(lambda p, f, so: (kind, p, {**f, "structured_outputs": so} if so is not None else f),
                     prompt, fields, constraint)


requests = st.one_of(
    _request("valid", valid_fields, served),  # must be served
    _request("grammar", valid_fields, engine_refused),  # reaches the engine; its grammar likely fails there
    _request("random", any_fields, st.one_of(st.none(), constraints), prompts),  # anything
)


def _params(kwargs: dict) -> vx.SamplingParams:
    kwargs = dict(kwargs)
    if "structured_outputs" in kwargs:
        kwargs["structured_outputs"] = SO(**kwargs["structured_outputs"])
    return vx.SamplingParams(**kwargs)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batch=st.lists(requests, min_size=1, max_size=4), num_healthy=st.integers(1, 2))
def test_random_hostile_requests_fail_alone_and_the_engine_lives(llm, reference, batch, num_healthy):
    """Random valid and invalid params, prompts and grammars beside healthy greedy requests: every bad one raises
    a ValueError of its own (at submission, or InvalidRequestError from the engine), never an internal error; valid
    ones are served; the engine lives on, nothing is left behind, and the healthy requests get the tokens they get
    alone."""
    engine = llm.llm_engine
    sent, must_finish = [], set()
    for i, (kind, prompt, kwargs) in enumerate(batch):
        rid = f"x{i}"
        try:
            engine.add_request(rid, prompt, _params(kwargs))
        except ValueError as e:
            assert kind != "valid", e
            event(f"{kind}: refused up front")
            continue  # refused up front: nothing reached the engine
        sent.append(rid)
        if kind == "valid":
            must_finish.add(rid)
    for j in range(num_healthy):
        engine.add_request(f"h{j}", HEALTHY_PROMPTS[j], HEALTHY)
    finals, refused = {}, []
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except InvalidRequestError as e:  # only the caller's input may be at fault; an internal error fails the test
            refused.append(str(e))
            continue
        finals.update((o.request_id, o) for o in outs if o.finished)
    for j in range(num_healthy):
        assert finals[f"h{j}"].outputs[0].token_ids == reference[j]
    refused_ids = {rid for m in refused for rid in re.findall(r"^The engine refused request '(\w+)'", m, re.M)}
    for i, (kind, _, _) in enumerate(batch):
        if f"x{i}" in sent:
            event(f"{kind}: {'refused by the engine' if f'x{i}' in refused_ids else 'served'}")
    assert set(finals) == set(sent) - refused_ids | {f"h{j}" for j in range(num_healthy)}
    assert must_finish <= set(finals)
    assert_idle(llm)
