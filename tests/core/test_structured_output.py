"""Structured output: grammars compile off the hot path, one bitmask per step masks the constrained rows, and the
text obeys its regex, choice, JSON schema or grammar (tiny random model, in-process engine)."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import numpy as np
import pytest
import torch
from tests.support.worker_view import WorkerView

import vx
from vx.cache import KVCacheManager
from vx.config import CacheConfig, ModelConfig, SchedulerConfig, StructuredOutputsConfig
from vx.core.grammar_masks import allowed_tokens
from vx.core.request import Request, RequestStatus
from vx.core.scheduler import Scheduler
from vx.core.structured_output import StructuredOutputManager, grammar_key
from vx.errors import EngineGenerateError, InvalidRequestError
from vx.gpu.grammar_bitmask import apply_grammar_bitmask
from vx.sampling_params import StructuredOutputsParams as SO
from vx.step import ModelRunnerOutput

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


def test_structural_tag_output_is_text_or_a_tag_with_its_schema(llm):
    """An xgrammar structural tag: either a JSON answer or a tagged call whose arguments fit their schema."""
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    def json_format(schema):  # whitespace bounded, as the server's tool grammar has it: a random model fills any
        return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}

    tag = {"type": "tag", "begin": "<call>", "content": json_format(SCHEMA), "end": "</call>"}
    spec = {"type": "structural_tag", "format": {"type": "or", "elements": [json_format(answer), tag]}}
    for c in completions(llm, greedy_and_seeded(SO(structural_tag=json.dumps(spec)), max_tokens=96)):
        assert c.finish_reason == "stop", c
        if c.text.startswith("<call>"):
            assert c.text.endswith("</call>")
            jsonschema.validate(json.loads(c.text[len("<call>"):-len("</call>")]), SCHEMA)
        else:
            jsonschema.validate(json.loads(c.text), answer)


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
        except InvalidRequestError as e:  # a ValueError: the server answers 400
            errors.append(str(e))
            continue
        finals.update((o.request_id, o) for o in outs if o.finished)
    assert len(errors) == 1 and re.search(f"refused request 'bad': {problem}", errors[0]), errors
    assert list(finals) == ["good"] and len(finals["good"].outputs[0].token_ids) == 8
    # vx.LLM.generate raises it for the whole call, and the engine stays usable.
    with pytest.raises(InvalidRequestError, match=problem):
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
def _manager(tokenizer_dir: str, **limits) -> StructuredOutputManager:
    cfg = ModelConfig(model=tokenizer_dir, tokenizer=tokenizer_dir, hf_config=None, architecture="Qwen3ForCausalLM",
                      dtype="float32", max_model_len=256, vocab_size=VOCAB, eos_token_ids=[EOS])
    return StructuredOutputManager(cfg, StructuredOutputsConfig(**{"compile_workers": 1, **limits}))


def _scheduler(mgr: StructuredOutputManager) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                     CacheConfig(block_size=4, enable_prefix_caching=True), KVCacheManager(64, 4, True), mgr,
                     max_model_len=256)


def _allowed(bitmask_row: np.ndarray) -> np.ndarray:
    """Token ids (within the model's vocabulary) whose bit is set in one bitmask row."""
    tokens = allowed_tokens(bitmask_row)
    return tokens[tokens < VOCAB]


def test_scheduler_admits_others_while_a_grammar_compiles(tiny_model_dir):
    """A request whose grammar still compiles is skipped, not waited for; once compiled it runs under one bitmask
    per step, and its matcher ends it when the grammar is complete."""
    mgr = _manager(tiny_model_dir)
    release = threading.Event()
    compile_fn = mgr._compile
    mgr._compile = lambda key: (release.wait(30), compile_fn(key))[1]  # hold the compile until released
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                  CacheConfig(block_size=4, enable_prefix_caching=True), KVCacheManager(64, 4, True), mgr,
                  max_model_len=256)
    s.add_request(Request("constrained", [5, 6, 7], vx.SamplingParams(
        max_tokens=20, ignore_eos=True, structured_outputs=SO(regex=REGEX)), [EOS]))
    s.add_request(Request("free", [5, 6, 7], vx.SamplingParams(max_tokens=2), [EOS]))

    view = WorkerView()
    so = view.apply(s.schedule())
    assert [r.req_id for r in so.scheduled] == ["free"] and so.grammar_bitmask is None
    assert [r.request_id for r in s.waiting] == ["constrained"]  # kept its place at the head of the queue
    s.update_from_output(so.output, ModelRunnerOutput(["free"], [9]))

    release.set()
    mgr.wait_for_compile(timeout=30)
    so = view.apply(s.schedule())
    assert {r.req_id for r in so.scheduled} == {"free", "constrained"}
    assert so.grammar_req_ids == ["constrained"] and so.grammar_bitmask.shape == (1, VOCAB // 32)
    allowed = _allowed(so.grammar_bitmask[0])
    assert set(allowed) <= set(range(TOKENIZER_SIZE))  # ids past the tokenizer are never allowed
    # Drive the request with the lowest allowed token each step: the text must follow the regex.
    tokens = []
    while "constrained" in s.requests:
        tokens.append(int(allowed[0]))
        sampled = [r.req_id for r in so.scheduled if r.samples]
        s.update_from_output(so.output, ModelRunnerOutput(sampled, [tokens[-1] if r == "constrained" else 9
                                                             for r in sampled]))
        so = view.apply(s.schedule())
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
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                  CacheConfig(block_size=4, enable_prefix_caching=True), KVCacheManager(64, 4, True), mgr,
                  max_model_len=256)
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


# ------------------------------------------------------------------------------------ compile limits
def _compile_alone(mgr: StructuredOutputManager, so: SO, rid: str = "r") -> list:
    """Run one request's compile to its end (matcher or error), then forget the request."""
    mgr.add_request(rid, so, [EOS])
    while not mgr.is_ready(rid):
        mgr.wait_for_compile(timeout=0.05)
        errors = mgr.update()
        if errors:
            return errors
    mgr.remove_request(rid)
    return []


REGEXES = [r"[a-z]{1,100}", r"[0-9a-f]{1,200}", r"[A-Z]{2,150}", r"(ab|cd|ef){1,60}"]


def test_grammar_cache_is_bounded_by_bytes(tiny_model_dir):
    """The cache counts xgrammar's memory_size_bytes of each compiled grammar and evicts the least recently used
    ones to stay within grammar_cache_memory_bytes; a grammar larger than the whole budget is served, not kept."""
    probe = _manager(tiny_model_dir)
    for r in REGEXES:
        assert _compile_alone(probe, SO(regex=r)) == []
    size = {key[1]: e.size for key, e in probe._cache.items()}
    assert all(n > 1000 for n in size.values()) and len(set(size.values())) == len(REGEXES), size
    assert probe.cache_bytes == sum(size.values())
    assert size[REGEXES[0]] == probe._cache[("regex", REGEXES[0])].future.result().memory_size_bytes
    probe.shutdown()

    a, b, c, d = REGEXES
    assert size[b] >= size[d]  # so that evicting `b` alone makes room for `d`
    mgr = _manager(tiny_model_dir, cache_memory_bytes=size[a] + size[b] + size[c])
    for r in (a, b, c):
        _compile_alone(mgr, SO(regex=r))
    assert [k[1] for k in mgr._cache] == [a, b, c] and mgr.cache_bytes == mgr.config.cache_memory_bytes
    _compile_alone(mgr, SO(regex=a))  # a hit: `a` becomes the most recently used
    _compile_alone(mgr, SO(regex=d))  # over budget: the least recently used (`b`) goes
    assert [k[1] for k in mgr._cache] == [c, a, d] and mgr.cache_bytes == size[c] + size[a] + size[d]
    mgr.shutdown()

    tiny = _manager(tiny_model_dir, cache_memory_bytes=size[a] - 1)
    assert _compile_alone(tiny, SO(regex=a)) == []  # served...
    assert tiny.cache_bytes == 0 and not tiny._cache  # ...but never kept
    tiny.shutdown()


def test_grammar_over_the_memory_limit_fails_its_request_alone(tiny_model_dir):
    """A compiled grammar over max_grammar_memory_bytes fails its request, as a client error, and is not cached;
    a small grammar beside it is served."""
    mgr = _manager(tiny_model_dir, max_grammar_memory_bytes=100 * 1024)
    s = _scheduler(mgr)
    s.add_request(Request("big", [5, 6], vx.SamplingParams(structured_outputs=SO(regex="[a-z]{1,1000}")), [EOS]))
    s.add_request(Request("small", [5, 6], vx.SamplingParams(max_tokens=3, structured_outputs=SO(regex=REGEX)),
                          [EOS]))
    errors, ran, view = [], set(), WorkerView()
    while s.has_unfinished_requests():
        mgr.wait_for_compile(timeout=0.05)
        so = view.apply(s.schedule())
        ran.update(r.req_id for r in so.scheduled)
        sampled = [r.req_id for r in so.scheduled if r.samples]
        out = s.update_from_output(so.output, ModelRunnerOutput(sampled, [int(_allowed(so.grammar_bitmask[0])[0])
                                                                   for _ in sampled]))
        errors += out.input_errors
    assert [(e.request_id, e.internal) for e in errors] == [("big", False)]
    assert re.search(r"structured_outputs.regex compiles to a grammar of 0.2 MiB, over the engine's limit of 0.1 MiB "
                     r"\(max_grammar_memory_bytes\)", errors[0].message), errors[0].message
    assert ran == {"small"} and s.kv_cache_manager.stats().num_blocks_in_use == 0
    assert mgr.cache_bytes < 10_000  # the refusal is remembered, the grammar is not
    mgr.shutdown()


def test_compile_timeout_fails_only_its_request(tiny_model_dir):
    """A compile past grammar_compile_timeout_s fails its own request (a client error) while another request's
    compile proceeds and it runs; the slow compile's result, when it comes, is discarded and not cached."""
    mgr = _manager(tiny_model_dir, compile_timeout_s=0.5, compile_workers=2)
    release = threading.Event()
    compile_fn = mgr._compile
    slow_key = grammar_key(SO(regex="s+l+o+w"))
    mgr._compile = lambda key: (key == slow_key and release.wait(30), compile_fn(key))[1]
    s = _scheduler(mgr)
    s.add_request(Request("slow", [5, 6], vx.SamplingParams(structured_outputs=SO(regex="s+l+o+w")), [EOS]))
    s.add_request(Request("fast", [5, 6], vx.SamplingParams(max_tokens=30, ignore_eos=True,
                                                             structured_outputs=SO(regex=REGEX)), [EOS]))
    errors, fast_steps, view = [], 0, WorkerView()
    t0 = time.monotonic()
    while s.has_unfinished_requests():
        assert time.monotonic() - t0 < 20
        mgr.wait_for_compile(timeout=0.05)
        so = view.apply(s.schedule())
        fast_steps += any(r.req_id == "fast" for r in so.scheduled)
        sampled = [r.req_id for r in so.scheduled if r.samples]
        tokens = [int(_allowed(so.grammar_bitmask[so.grammar_req_ids.index(r)])[0]) for r in sampled]
        errors += s.update_from_output(so.output, ModelRunnerOutput(sampled, tokens)).input_errors
    assert [(e.request_id, e.internal) for e in errors] == [("slow", False)]
    assert "structured_outputs.regex is too costly to compile: compiling took longer than 0.5 s" in errors[0].message
    assert fast_steps > 0 and s.kv_cache_manager.stats().num_blocks_in_use == 0
    assert mgr._pool.num_abandoned == 1 and slow_key not in mgr._cache
    release.set()
    assert _compile_alone(mgr, SO(regex=REGEX)) == []
    deadline = time.monotonic() + 10
    while mgr._pool.num_threads:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    mgr.update()
    assert slow_key not in mgr._cache  # the late result was dropped, never cached
    mgr.shutdown()


def test_a_failing_matcher_fails_its_request_alone(tiny_model_dir):
    """A matcher that raises while filling the bitmask, or while accepting a token, fails its own request (an
    internal error) and frees its blocks; the other constrained request goes on to its end."""
    mgr = _manager(tiny_model_dir)
    s = _scheduler(mgr)
    for rid in ("a", "b", "c"):
        s.add_request(Request(rid, [5, 6, 7], vx.SamplingParams(max_tokens=40, structured_outputs=SO(regex=REGEX)),
                              [EOS]))
    while mgr.num_pending:
        mgr.wait_for_compile(timeout=0.05)
        mgr.update()

    class Broken:
        def __init__(self, matcher, method):
            self.matcher, self.method = matcher, method

        def __getattr__(self, name):
            if name == self.method:
                raise RuntimeError(f"injected {name} failure")
            return getattr(self.matcher, name)

    mgr._requests["a"].matcher = Broken(mgr._requests["a"].matcher, "fill_next_token_bitmask")
    mgr._requests["b"].matcher = Broken(mgr._requests["b"].matcher, "accept_token")
    errors, tokens, view = [], [], WorkerView()
    while s.has_unfinished_requests():
        so = view.apply(s.schedule())
        sampled = [r.req_id for r in so.scheduled if r.samples]
        rows = [so.grammar_req_ids.index(r) for r in sampled]
        step_tokens = [int(_allowed(so.grammar_bitmask[i])[0]) for i in rows]
        tokens += [t for r, t in zip(sampled, step_tokens) if r == "c"]
        errors += s.update_from_output(so.output, ModelRunnerOutput(sampled, step_tokens)).input_errors
    assert sorted((e.request_id, e.internal) for e in errors) == [("a", True), ("b", True)]
    assert all("structured output failed: RuntimeError: injected" in e.message for e in errors)
    assert tokens[-1] == EOS and s.kv_cache_manager.stats().num_blocks_in_use == 0 and mgr.num_requests == 0
    from transformers import PreTrainedTokenizerFast

    text = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir).decode(tokens, skip_special_tokens=True)
    assert re.fullmatch(REGEX, text), text
    mgr.shutdown()


def test_a_compile_that_cannot_start_in_time_is_an_overload_not_an_internal_error(tiny_model_dir):
    """Every compile thread busy past the deadline (one worker, and as many abandoned compiles as the pool lets pile
    up): the waiting request fails as overloaded (the caller may retry, and the server answers 503 with
    Retry-After), not as its input's fault and not as an internal error."""
    mgr = _manager(tiny_model_dir, compile_timeout_s=0.3, compile_workers=1)
    release = threading.Event()
    compile_fn = mgr._compile
    slow_keys = {grammar_key(SO(regex="s+l+o+w")), grammar_key(SO(regex="w+o+l+s"))}
    mgr._compile = lambda key: (key in slow_keys and release.wait(30), compile_fn(key))[1]
    try:
        mgr.add_request("slow-1", SO(regex="s+l+o+w"), [EOS])
        mgr.add_request("slow-2", SO(regex="w+o+l+s"), [EOS])
        mgr.add_request("queued", SO(regex=REGEX), [EOS])
        errors = []
        t0 = time.monotonic()
        while not any(e.request_id == "queued" for e in errors):
            assert time.monotonic() - t0 < 10 and mgr.is_ready("queued") is False
            mgr.wait_for_compile(timeout=0.05)
            errors += mgr.update()
        queued = next(e for e in errors if e.request_id == "queued")
        assert (queued.overloaded, queued.internal) == (True, False)
        assert isinstance(queued.to_exception("q"), vx.EngineOverloadedError)
        assert not isinstance(queued.to_exception("q"), ValueError)
    finally:
        release.set()
        mgr.shutdown()
