"""OutputProcessor: incremental detokenization, stop strings, output kinds, finish and abort bookkeeping."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vx.client.detokenizer import IncrementalDetokenizer
from vx.client.output_processor import OutputProcessor, ProcessedOutputs
from vx.core.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from vx.outputs import RequestOutput
from vx.sampling_params import RequestOutputKind, SamplingParams

CUM, DELTA, FINAL = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
MULTIBYTE = "Paris, France: héllo wörld – 日本語 🎉🚀 naïve café, 42 × 7 = 294 ✓. The end!"
PROMPT = "The capital of France is"


def make_request(tokenizer, rid: str = "r", prompt: str = PROMPT, **params) -> EngineCoreRequest:
    params.setdefault("max_tokens", 1000)
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=tokenizer.encode(prompt),
        sampling_params=SamplingParams(**params),
        eos_token_ids=[0],
    )


def step(op: OutputProcessor, rid: str, ids: list[int], finish: FinishReason | None = None,
         stop_reason: int | str | None = None, cached: int = 0) -> ProcessedOutputs:
    out = EngineCoreOutput(request_id=rid, new_token_ids=ids, finish_reason=finish, stop_reason=stop_reason,
                           num_cached_tokens=cached)
    return op.process_outputs([out])


def run(op: OutputProcessor, rid: str, chunks: list[list[int]], finish=FinishReason.LENGTH,
        stop_reason=None) -> list[RequestOutput]:
    """Feed chunks (the last one finishing the request); return every RequestOutput produced."""
    outs: list[RequestOutput] = []
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        outs += step(op, rid, chunk, finish if last else None, stop_reason if last else None).request_outputs
    return outs


def one_by_one(ids: list[int]) -> list[list[int]]:
    return [[t] for t in ids]


# ------------------------------------------------------------------ detokenization
@pytest.mark.parametrize("kind", [CUM, DELTA])
def test_stream_of_multibyte_text_equals_full_decode(tokenizer, kind):
    ids = tokenizer.encode(MULTIBYTE * 3)
    op = OutputProcessor(tokenizer)
    op.add_request(make_request(tokenizer, output_kind=kind), PROMPT)
    outs = run(op, "r", one_by_one(ids))
    assert len(outs) == len(ids)
    expected = tokenizer.decode(ids)
    assert expected == MULTIBYTE * 3
    if kind == DELTA:
        assert "".join(o.outputs[0].text for o in outs) == expected
        assert sum((o.outputs[0].token_ids for o in outs), []) == ids
    else:
        assert all(expected.startswith(o.outputs[0].text) for o in outs)
        assert outs[-1].outputs[0].text == expected and outs[-1].outputs[0].token_ids == ids
    final = outs[-1]
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert final.prompt == PROMPT and final.prompt_token_ids == tokenizer.encode(PROMPT)
    assert op.request_states == {}


def test_partial_character_is_never_shown_and_flushed_at_end(tokenizer):
    ids = tokenizer.encode("a日🎉")
    assert len(ids) >= 5  # the tiny tokenizer has no merges for these: one token per byte
    op = OutputProcessor(tokenizer)
    op.add_request(make_request(tokenizer, output_kind=DELTA), None)
    texts = [o.outputs[0].text for o in run(op, "r", one_by_one(ids))]
    assert "".join(texts) == "a日🎉" and not any("\ufffd" in t for t in texts)
    assert "" in texts  # steps that only carried part of a character showed nothing
    # A request that ends in the middle of a character shows U+FFFD for it, as tokenizer.decode does.
    cut = tokenizer.encode("日本")[:-1]
    op.add_request(make_request(tokenizer, rid="c", output_kind=CUM), None)
    outs = run(op, "c", one_by_one(cut))
    assert outs[-1].outputs[0].text == tokenizer.decode(cut) and outs[-1].outputs[0].text.endswith("\ufffd")


class _MetaspaceTokenizer:
    """A SentencePiece-style tokenizer: decode strips the leading space of the very first word only."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁again": 3}
        self._tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        self._tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        self._tokenizer.decoder = decoders.Metaspace()


def test_prompt_prefill_keeps_leading_space():
    tok = _MetaspaceTokenizer()
    assert tok._tokenizer.decode([2]) == "world"  # alone, the space is stripped ...
    d = IncrementalDetokenizer(tok, [1], skip_special_tokens=True)
    assert d.push([2]) + d.push([3]) == " world again"  # ... after the prompt "Hello" it must stay


def test_detokenizer_recovers_when_the_stream_fails(tokenizer):
    class Broken:
        def step(self, backend, token_id):
            raise RuntimeError("invalid prefix")

    ids = tokenizer.encode(MULTIBYTE)
    for i in range(len(ids)):  # break the stream before every token: inside characters too
        d = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT), True)
        text = d.push(ids[:i])
        d._stream = Broken()
        text += d.push(ids[i:i + 1])
        d._stream = Broken() if i % 2 else d._stream
        text += d.push(ids[i + 1:]) + d.flush()
        assert text == MULTIBYTE, i


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, skip):
    ids = [1] + tokenizer.encode("assistant\nParis") + [2]  # <|im_start|> ... <|im_end|>
    op = OutputProcessor(tokenizer)
    op.add_request(make_request(tokenizer, skip_special_tokens=skip), None)
    text = run(op, "r", one_by_one(ids))[-1].outputs[0].text
    assert text == ("assistant\nParis" if skip else "<|im_start|>assistant\nParis<|im_end|>")
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_hidden_unless_included(tokenizer, include):
    ids = tokenizer.encode("Paris") + [0]
    op = OutputProcessor(tokenizer)
    op.add_request(make_request(tokenizer, skip_special_tokens=False, include_stop_str_in_output=include), None)
    out = run(op, "r", [ids], finish=FinishReason.STOP)[-1].outputs[0]
    assert out.text == "Paris" + ("<|endoftext|>" if include else "")
    assert out.token_ids == ids and out.finish_reason == "stop" and out.stop_reason is None


# ------------------------------------------------------------------ engine finishes
@pytest.mark.parametrize(
    "finish, stop_reason, name",
    [(FinishReason.STOP, 7, "stop"), (FinishReason.LENGTH, None, "length"), (FinishReason.ABORT, None, "abort")],
)
def test_engine_finish_reasons(tokenizer, finish, stop_reason, name):
    op = OutputProcessor(tokenizer)
    op.add_request(make_request(tokenizer), PROMPT)
    first = step(op, "r", tokenizer.encode(" Paris"), cached=16)
    assert first.reqs_to_abort == [] and not first.request_outputs[0].finished
    res = step(op, "r", [7], finish, stop_reason)
    out = res.request_outputs[0]
    assert out.finished and out.outputs[0].finish_reason == name and out.outputs[0].stop_reason == stop_reason
    assert out.num_cached_tokens == 16 and res.reqs_to_abort == []
    assert not op.has_unfinished_requests() and op.request_states == {}


# ------------------------------------------------------------------ stop strings
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("per_call", [False, True])
def test_stop_string_spanning_tokens_is_cut_exactly(tokenizer, include, per_call):
    text = " Paris. Paris is a large city on the river Seine."
    ids = tokenizer.encode(text)
    stop = "is a large"
    op = OutputProcessor(tokenizer)
    op.add_request(make_request(tokenizer, stop=["xyz", stop], include_stop_str_in_output=include), PROMPT)
    chunks = one_by_one(ids) if per_call else [ids[:len(ids) // 2], ids[len(ids) // 2:]]
    aborts, outs = [], []
    for chunk in chunks:  # the engine keeps sending steps until it learns of the abort: they are ignored
        res = step(op, "r", chunk)
        aborts += res.reqs_to_abort
        outs += res.request_outputs
    final = outs[-1]
    assert final.finished and all(not o.finished for o in outs[:-1])
    expected = " Paris. Paris " + (stop if include else "")
    assert final.outputs[0].text == expected
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
    assert aborts == ["r"] and op.request_states == {}
    # Token ids keep every token the engine generated up to the stop.
    assert tokenizer.decode(final.outputs[0].token_ids).startswith(" Paris. Paris is a large")


def test_stop_string_inside_one_token_step_with_engine_finish(tokenizer):
    # The engine finished this request in the same step: nothing to abort, the stop string still wins.
    op = OutputProcessor(tokenizer)
    op.add_request(make_request(tokenizer, stop=["France"]), None)
    res = step(op, "r", tokenizer.encode(" in France and"), FinishReason.LENGTH)
    out = res.request_outputs[0].outputs[0]
    assert out.text == " in " and out.finish_reason == "stop" and out.stop_reason == "France"
    assert res.reqs_to_abort == []


def test_earliest_stop_string_wins(tokenizer):
    op = OutputProcessor(tokenizer)
    op.add_request(make_request(tokenizer, stop=["city", "large"]), None)
    out = run(op, "r", [tokenizer.encode(" a large city")])[-1].outputs[0]
    assert out.text == " a " and out.stop_reason == "large"


def test_partial_stop_string_never_visible_in_deltas(tokenizer):
    stop = "Paris is"
    text = " Paris. Paris, and Paris is big."
    ids = tokenizer.encode(text)
    op = OutputProcessor(tokenizer)
    op.add_request(make_request(tokenizer, stop=[stop], output_kind=DELTA), None)
    shown = ""
    for i, out in enumerate(run(op, "r", one_by_one(ids))):
        shown += out.outputs[0].text
        if not out.finished:
            assert " Paris. Paris, and ".startswith(shown)  # what is shown is never taken back
            # A tail of the text so far that may still grow into "Paris is" is not shown yet.
            so_far = tokenizer.decode(ids[: i + 1])
            for k in range(1, len(stop)):
                if so_far.endswith(stop[:k]):
                    assert len(shown) <= len(so_far) - k, (so_far, shown)
    assert shown == " Paris. Paris, and "


def test_held_back_text_released_at_end(tokenizer):
    op = OutputProcessor(tokenizer)
    op.add_request(make_request(tokenizer, stop=["Paris is"], output_kind=DELTA), None)
    outs = run(op, "r", one_by_one(tokenizer.encode(" to Paris")))
    assert "Pa" not in "".join(o.outputs[0].text for o in outs[:-1])  # might have become "Paris is"
    assert "".join(o.outputs[0].text for o in outs) == " to Paris"
    assert outs[-1].outputs[0].finish_reason == "length" and outs[-1].outputs[0].stop_reason is None


# ------------------------------------------------------------------ output kinds
def test_output_kinds_agree(tokenizer):
    ids = tokenizer.encode(MULTIBYTE)
    chunks = [ids[i:i + 3] for i in range(0, len(ids), 3)]
    results = {}
    for kind in (CUM, DELTA, FINAL):
        op = OutputProcessor(tokenizer)
        op.add_request(make_request(tokenizer, output_kind=kind, stop=["✓."]), None)
        results[kind] = run(op, "r", chunks)
        assert op.request_states == {}
    assert len(results[FINAL]) == 1 and results[FINAL][0].finished
    final = results[FINAL][0].outputs[0]
    assert final.text == MULTIBYTE[: MULTIBYTE.index("✓.")]
    assert results[CUM][-1].outputs[0].text == final.text
    assert "".join(o.outputs[0].text for o in results[DELTA]) == final.text
    assert sum((o.outputs[0].token_ids for o in results[DELTA]), []) == final.token_ids
    assert results[CUM][-1].outputs[0].token_ids == final.token_ids
    assert len(results[CUM]) == len(results[DELTA])


# ------------------------------------------------------------------ bookkeeping
def test_duplicate_request_id_refused(tokenizer):
    op = OutputProcessor(tokenizer)
    op.add_request(make_request(tokenizer), None)
    with pytest.raises(ValueError, match="already in flight"):
        op.add_request(make_request(tokenizer), None)
    assert op.get_num_unfinished_requests() == 1
    run(op, "r", [[5]])
    op.add_request(make_request(tokenizer), None)  # a finished id may be used again


def test_abort_requests(tokenizer):
    op = OutputProcessor(tokenizer)
    op.add_request(make_request(tokenizer, rid="a", output_kind=DELTA, stop=["Paris is"]), None)
    op.add_request(make_request(tokenizer, rid="b", output_kind=FINAL), None)
    op.add_request(make_request(tokenizer, rid="c"), None)
    assert op.get_num_unfinished_requests() == 3 and op.has_unfinished_requests()
    ids = tokenizer.encode(" to Paris")
    step(op, "a", ids)
    step(op, "b", ids)
    finals = op.abort_requests(["a", "b", "unknown"])
    assert [f.request_id for f in finals] == ["a", "b"]
    assert all(f.finished and f.outputs[0].finish_reason == "abort" for f in finals)
    assert finals[1].outputs[0].text == " to Paris"  # FINAL_ONLY: everything, once
    assert set(op.request_states) == {"c"}
    # Late engine outputs for aborted requests are ignored.
    assert step(op, "a", [5], FinishReason.ABORT).request_outputs == []
    assert op.abort_requests(["c"])[0].outputs[0].token_ids == []
    assert op.request_states == {} and not op.has_unfinished_requests()


def test_delta_abort_returns_held_back_text(tokenizer):
    op = OutputProcessor(tokenizer)
    op.add_request(make_request(tokenizer, output_kind=DELTA, stop=["Paris is"]), None)
    shown = "".join(o.outputs[0].text for o in run(op, "r", [tokenizer.encode(" to Paris")], finish=None))
    rest = op.abort_requests(["r"])[0].outputs[0].text
    assert shown + rest == " to Paris" and rest


def test_without_tokenizer_only_token_ids(tokenizer):
    op = OutputProcessor(None)
    op.add_request(make_request(tokenizer), None)
    out = run(op, "r", [[5, 6], [7]])[-1].outputs[0]
    assert out.text == "" and out.token_ids == [5, 6, 7]


# ------------------------------------------------------------------ properties
_TEXT = st.text(alphabet=st.sampled_from(list("abc Paris.,!?\n-– éö日本🎉")), max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 399), max_size=40), prompt=st.lists(st.integers(0, 399), max_size=10),
       cuts=st.lists(st.integers(1, 4), min_size=1, max_size=40), skip=st.booleans())
def test_random_tokens_deltas_equal_full_decode(tokenizer, ids, prompt, cuts, skip):
    op = OutputProcessor(tokenizer)
    op.add_request(EngineCoreRequest(request_id="r", prompt_token_ids=prompt or [5],
                                     sampling_params=SamplingParams(output_kind=DELTA, skip_special_tokens=skip)))
    chunks, i = [], 0
    for c in cuts:
        chunks.append(ids[i:i + c])
        i += c
    chunks.append(ids[i:])
    outs = run(op, "r", chunks)
    assert "".join(o.outputs[0].text for o in outs) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert sum((o.outputs[0].token_ids for o in outs), []) == ids and op.request_states == {}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_TEXT, stop=st.text(alphabet=st.sampled_from(list("aP.s 日🎉")), min_size=1, max_size=4),
       include=st.booleans(), cut=st.integers(1, 3))
def test_stop_string_property(tokenizer, text, stop, include, cut):
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids)
    op = OutputProcessor(tokenizer)
    op.add_request(make_request(tokenizer, stop=[stop], include_stop_str_in_output=include, output_kind=DELTA))
    shown, outs = "", run(op, "r", [ids[i:i + cut] for i in range(0, len(ids), cut)] or [[]])
    pos = full.find(stop)
    expected = full if pos < 0 else full[: pos + (len(stop) if include else 0)]
    for o in outs:
        shown += o.outputs[0].text
        assert expected.startswith(shown)  # nothing shown is ever taken back
    assert shown == expected and op.request_states == {}
    assert outs[-1].outputs[0].stop_reason == (stop if pos >= 0 else None)


# ------------------------------------------------------------------------------------- n > 1 (parent requests)
@pytest.mark.parametrize("kind", [CUM, DELTA, FINAL])
def test_parallel_samples_gather_into_one_request(tokenizer, kind):
    op = OutputProcessor(tokenizer)
    children = op.add_request(make_request(tokenizer, "p", n=3, seed=5, output_kind=kind, prompt_logprobs=1))
    assert [c.request_id for c in children] == ["0_p", "1_p", "2_p"]
    assert [c.sampling_params.seed for c in children] == [5, 6, 7] and all(c.sampling_params.n == 1 for c in children)
    assert [c.sampling_params.prompt_logprobs for c in children] == [1, None, None]
    assert op.get_num_unfinished_requests() == 1 and op.engine_request_ids(["p"]) == ["0_p", "1_p", "2_p"]
    assert op.request_id_of("1_p") == "p" and op.request_ids() == ["p"]
    hello, world = tokenizer.encode("Hello"), tokenizer.encode(" world")
    outs = step(op, "1_p", hello).request_outputs + step(op, "0_p", world).request_outputs
    outs += step(op, "1_p", world, FinishReason.LENGTH).request_outputs
    outs += step(op, "2_p", hello + [0], FinishReason.STOP).request_outputs
    assert op.get_num_unfinished_requests() == 1 and not any(o.finished for o in outs)
    outs += step(op, "0_p", hello, FinishReason.LENGTH).request_outputs
    assert all(o.request_id == "p" for o in outs) and outs[-1].finished
    assert op.parent_requests == {} and op.request_states == {} and not op.has_unfinished_requests()
    if kind == FINAL:
        assert len(outs) == 1
    if kind == DELTA:
        texts = {0: "", 1: "", 2: ""}
        for o in outs:
            assert len(o.outputs) == 1
            texts[o.outputs[0].index] += o.outputs[0].text
    else:
        texts = {c.index: c.text for c in outs[-1].outputs}
    assert texts == {0: " worldHello", 1: "Hello world", 2: "Hello"}  # 2 ended on eos, which is not shown
    assert [c.finish_reason for c in outs[-1].outputs if kind != DELTA] in ([], ["length", "length", "stop"])


def test_aborting_a_parent_ends_every_sample(tokenizer):
    op = OutputProcessor(tokenizer)
    op.add_request(make_request(tokenizer, "p", n=2))
    step(op, "0_p", tokenizer.encode("Hi"))
    finals = op.abort_requests(["p"])
    assert finals[-1].finished and [c.finish_reason for c in finals[-1].outputs] == ["abort", "abort"]
    assert op.parent_requests == {} and op.request_states == {}
    with pytest.raises(ValueError, match="unique"):
        op.add_request(make_request(tokenizer, "q", n=2))
        op.add_request(make_request(tokenizer, "q"))
