"""Structured output: grammars compile off the hot path, one bitmask per step masks the constrained rows, and the
text obeys its regex, choice, JSON schema or grammar (tiny random model, in-process engine)."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import numpy as np
import pytest
import torch

import vx
from vx.cache import KVCacheManager
from vx.config import CacheConfig, ModelConfig, SchedulerConfig
from vx.core.request import Request, RequestStatus
from vx.core.scheduler import Scheduler
from vx.core.scheduler_output import ModelRunnerOutput
from vx.core.structured_output import StructuredOutputManager
from vx.errors import EngineGenerateError
from vx.gpu.grammar_bitmask import apply_grammar_bitmask
from vx.sampling_params import StructuredOutputsParams as SO

ENGINE_KWARGS = dict(dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=200, block_size=16)
VOCAB = 512  # the tiny model's vocabulary; its tokenizer has only 400 tokens
TOKENIZER_SIZE = 400
EOS = 0
REGEX = r"[0-9]{3}-[a-z]{2}"
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"type": "string", "maxLength": 5},
    },
    "required": ["color", "n", "tag"],
}
SEEDS = range(6)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = vx.LLM(tiny_model_dir, **ENGINE_KWARGS)
    yield engine
    engine.shutdown()


def greedy_and_seeded(so: SO, max_tokens: int = 64, **kw) -> list[vx.SamplingParams]:
    """One greedy request and one seeded temperature-1 request per seed, all under `so`."""
    return ([vx.SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so, **kw)]
            + [vx.SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured_outputs=so, **kw)
               for s in SEEDS])


def completions(llm: vx.LLM, params: list[vx.SamplingParams], prompt: str = "hello") -> list[vx.CompletionOutput]:
    return [o.outputs[0] for o in llm.generate([prompt] * len(params), params, use_tqdm=False)]


# ------------------------------------------------------------------------------------- through vx.LLM
def test_regex_output_fully_matches(llm):
    for c in completions(llm, greedy_and_seeded(SO(regex=REGEX))):
        assert re.fullmatch(REGEX, c.text), c.text
        assert c.finish_reason == "stop" and c.token_ids[-1] == EOS  # the grammar ends with the stop token


def test_choice_output_is_one_of_the_choices(llm):
    # Quotes, backslashes, newlines and non-ASCII must reach the grammar escaped, and come back verbatim.
    choices = ["red", 'light "blue"', "back\\slash", "two\nlines", "grün"]
    got = [c.text for c in completions(llm, greedy_and_seeded(SO(choice=choices)))]
    assert all(t in choices for t in got), got


@pytest.mark.parametrize("as_text", [False, True], ids=["dict", "json-text"])
def test_json_schema_output_parses_and_validates(llm, as_text):
    so = SO(json=json.dumps(SCHEMA) if as_text else SCHEMA)
    for c in completions(llm, greedy_and_seeded(so, max_tokens=96)):
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_ebnf_grammar_output_is_in_its_language(llm):
    grammar = 'root ::= ("yes" | "no") ", " [0-9] [0-9]?'
    for c in completions(llm, greedy_and_seeded(SO(grammar=grammar))):
        assert re.fullmatch(r"(yes|no), [0-9]{1,2}", c.text), c.text


def test_grammar_wins_over_ignore_eos(llm):
    """With ignore_eos the stop token does not end the request, but the completed grammar does."""
    for c in completions(llm, greedy_and_seeded(SO(regex=REGEX), max_tokens=40, ignore_eos=True)):
        assert re.fullmatch(REGEX, c.text) and c.finish_reason == "stop", c


def test_mixed_batch_masks_only_constrained_rows(llm):
    """A constrained row comes out the same alone or in a batch, and unconstrained rows next to it are untouched
    (same tokens as when they run alone): the bitmask reaches exactly its own rows."""
    free_greedy = vx.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    free_seeded = vx.SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    regex_seeded = vx.SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=SO(regex=REGEX))
    json_greedy = vx.SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=SO(json=SCHEMA))
    batch = [free_greedy, regex_seeded, free_seeded, json_greedy]
    together = completions(llm, batch)
    alone = [completions(llm, [p])[0] for p in batch]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert re.fullmatch(REGEX, together[1].text)
    jsonschema.validate(json.loads(together[3].text), SCHEMA)


@pytest.mark.parametrize("so, problem", [
    (SO(regex="[0-9"), "structured_outputs.regex is invalid: .*Unclosed"),
    (SO(json={"type": "nonsense"}), "structured_outputs.json is invalid: .*nonsense"),
    (SO(grammar="root ::= undefined_rule"), "structured_outputs.grammar is invalid: .*undefined_rule"),
], ids=["regex", "json", "grammar"])
def test_uncompilable_constraint_fails_alone(llm, so, problem):
    """The engine refuses the request whose grammar does not compile, naming the problem; the request next to it
    completes, and the engine serves on."""
    engine = llm.llm_engine
    engine.add_request("good", "hello", vx.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.add_request("bad", "hello", vx.SamplingParams(max_tokens=8, structured_outputs=so))
    errors, finals = [], {}
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except EngineGenerateError as e:
            errors.append(str(e))
            continue
        finals.update((o.request_id, o) for o in outs if o.finished)
    assert len(errors) == 1 and re.search(f"refused request 'bad': {problem}", errors[0]), errors
    assert list(finals) == ["good"] and len(finals["good"].outputs[0].token_ids) == 8
    # vx.LLM.generate raises it for the whole call, and the engine stays usable.
    with pytest.raises(EngineGenerateError, match=problem):
        llm.generate(["a", "b"], [vx.SamplingParams(max_tokens=4),
                                  vx.SamplingParams(max_tokens=4, structured_outputs=so)], use_tqdm=False)
    assert re.fullmatch(REGEX, completions(llm, [vx.SamplingParams(structured_outputs=SO(regex=REGEX))])[0].text)
    assert llm.stats().kv_blocks_in_use == 0 and llm.stats().num_waiting == 0


def test_parallel_samples_each_follow_the_grammar(llm):
    """n > 1: every sample has its own matcher; an uncompilable grammar fails the whole request once."""
    out = llm.generate("hello", vx.SamplingParams(n=3, seed=1, max_tokens=40, structured_outputs=SO(regex=REGEX)),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3 and all(re.fullmatch(REGEX, c.text) for c in out.outputs), out.outputs
    with pytest.raises(EngineGenerateError, match=r"refused request '\d+': structured_outputs.regex is invalid"):
        llm.generate("hello", vx.SamplingParams(n=3, max_tokens=4, structured_outputs=SO(regex="[0-9")),
                     use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests() and llm.stats().kv_blocks_in_use == 0


@pytest.mark.parametrize("so, problem", [
    (SO(json="{not json"), "structured_outputs.json is not a valid JSON schema"),
    (SO(json="[1, 2]"), "must be a JSON schema object"),
    (SO(json={"type": "object", "default": {1, 2}}), "not a valid JSON schema"),
    (SO(choice=["a", ""]), "choice entries must be non-empty"),
    (SO(regex="a\x00b"), "must not contain a NUL"),
])
def test_front_end_refuses_malformed_constraints(llm, so, problem):
    with pytest.raises(ValueError, match=problem):
        llm.generate("hello", vx.SamplingParams(structured_outputs=so), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


# ------------------------------------------------------------------------------- scheduler and runner
def _manager(tokenizer_dir: str) -> StructuredOutputManager:
    cfg = ModelConfig(model=tokenizer_dir, tokenizer=tokenizer_dir, hf_config=None, architecture="Qwen3ForCausalLM",
                      dtype="float32", max_model_len=256, vocab_size=VOCAB, eos_token_ids=[EOS])
    return StructuredOutputManager(cfg, max_workers=1)


def _allowed(bitmask_row: np.ndarray) -> np.ndarray:
    """Token ids whose bit is set in one bitmask row."""
    bits = (bitmask_row[:, None].astype(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
    return np.flatnonzero(bits.reshape(-1)[:VOCAB])


def test_scheduler_admits_others_while_a_grammar_compiles(tiny_model_dir):
    """A request whose grammar still compiles is skipped, not waited for; once compiled it runs under one bitmask
    per step, and its matcher ends it when the grammar is complete."""
    mgr = _manager(tiny_model_dir)
    release = threading.Event()
    compile_fn = mgr._compile
    mgr._compile = lambda key: (release.wait(30), compile_fn(key))[1]  # hold the compile until released
    s = Scheduler(SchedulerConfig(8, 64, 256, True), CacheConfig(block_size=4, enable_prefix_caching=True),
                  KVCacheManager(64, 4, True), mgr)
    s.add_request(Request("constrained", [5, 6, 7], vx.SamplingParams(
        max_tokens=20, ignore_eos=True, structured_outputs=SO(regex=REGEX)), [EOS]))
    s.add_request(Request("free", [5, 6, 7], vx.SamplingParams(max_tokens=2), [EOS]))

    so = s.schedule()
    assert [r.req_id for r in so.scheduled] == ["free"] and so.grammar_bitmask is None
    assert [r.request_id for r in s.waiting] == ["constrained"]  # kept its place at the head of the queue
    s.update_from_output(so, ModelRunnerOutput(["free"], [9]))

    release.set()
    mgr.wait_for_compile(timeout=30)
    so = s.schedule()
    assert {r.req_id for r in so.scheduled} == {"free", "constrained"}
    assert so.grammar_req_ids == ["constrained"] and so.grammar_bitmask.shape == (1, VOCAB // 32)
    allowed = _allowed(so.grammar_bitmask[0])
    assert set(allowed) <= set(range(TOKENIZER_SIZE))  # ids past the tokenizer are never allowed
    # Drive the request with the lowest allowed token each step: the text must follow the regex.
    tokens = []
    while "constrained" in s.requests:
        tokens.append(int(allowed[0]))
        sampled = [r.req_id for r in so.scheduled if r.samples]
        s.update_from_output(so, ModelRunnerOutput(sampled, [tokens[-1] if r == "constrained" else 9
                                                             for r in sampled]))
        so = s.schedule()
        if so.grammar_req_ids:
            allowed = _allowed(so.grammar_bitmask[0])
    assert tokens[-1] == EOS and len(tokens) < 20  # ended by the grammar (ignore_eos is set), not by max_tokens
    from transformers import PreTrainedTokenizerFast

    text = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir).decode(tokens, skip_special_tokens=True)
    assert re.fullmatch(REGEX, text), text
    assert mgr.num_requests == 0
    mgr.shutdown()


def test_abort_while_compiling_and_cache(tiny_model_dir):
    """Requests sharing a constraint share one compile; aborting a request drops its grammar state."""
    mgr = _manager(tiny_model_dir)
    s = Scheduler(SchedulerConfig(8, 64, 256, True), CacheConfig(block_size=4, enable_prefix_caching=True),
                  KVCacheManager(64, 4, True), mgr)
    for rid in ("a", "b"):
        s.add_request(Request(rid, [5, 6], vx.SamplingParams(structured_outputs=SO(json=SCHEMA)), [EOS]))
    assert len(mgr._cache) == 1 and mgr.num_pending == 2
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert mgr.num_requests == 1 and mgr.num_pending == 1
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert mgr.num_requests == 0 and not s.has_unfinished_requests()
    mgr.shutdown()


def test_apply_grammar_bitmask_masks_only_its_rows():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    bitmask = np.zeros((1, VOCAB // 32), dtype=np.int32)
    bitmask[0, 0] = 0b1011  # tokens 0, 1 and 3 allowed
    bitmask[0, -1] = np.int32(-2**31)  # and the last token (bit 31 of the last word)
    apply_grammar_bitmask(logits, bitmask, ["b"], ["a", "b", "c"])
    assert torch.equal(logits[[0, 2]], before[[0, 2]])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed == [0, 1, 3, VOCAB - 1] and torch.equal(logits[1, allowed], before[1, allowed])
