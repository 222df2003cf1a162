"""SamplingParams validation: every field refuses values out of range and of the wrong type with a ValueError
that names the field, at construction, in `clone`, and (through `verify`) after a change in place."""

from __future__ import annotations

import json

import msgspec
import pytest

import vx
from vx import sampling_params as sp
from vx.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

NAN, INF = float("nan"), float("inf")

# field -> values it must refuse. Every field of SamplingParams appears (a test checks it).
BAD_VALUES: dict[str, list] = {
    "n": [0, -1, 1.0, True, "1", None, 2**63],
    "temperature": [-0.1, NAN, INF, "0", True, None],
    "top_p": [0.0, 1.1, -1, NAN, "1", True, None],
    "top_k": [-2, -1.0, 1.5, True, "3", None, 2**63, 10**20],
    "min_p": [-0.1, 1.1, NAN, "0", True, None],
    "seed": [2**63, -(2**63) - 1, 1.5, True, "1"],
    "max_tokens": [0, -1, 1.5, True, "16", 2**63],
    "min_tokens": [-1, 1.5, True, "1", None, 17],  # 17 > max_tokens (16)
    "stop": [[""], [1], ["a", None], 5, ("a",), b"x", "\ud800", ["ok", "\udfff"], {"a"},
             ["s"] * (sp.MAX_STOP_STRINGS + 1), ["s" * (sp.MAX_STOP_STRING_CHARS + 1)]],
    "stop_token_ids": [[-1], [1.0], [True], 3, "1", (1, 2), [None], [2**63], [1] * (sp.MAX_STOP_TOKEN_IDS + 1)],
    "ignore_eos": [1, 0, "yes", None],
    "skip_special_tokens": [1, None],
    "spaces_between_special_tokens": [0, None],
    "include_stop_str_in_output": [1, None],
    "output_kind": [5, -1, "delta", True, None, 1.0],
    "logprobs": [-1, 1.5, True, "1", sp.MAX_LOGPROBS + 1, 2**63],
    "prompt_logprobs": [-1, 1.5, True, sp.MAX_LOGPROBS + 1],
    "presence_penalty": [-2.1, 2.1, NAN, INF, "0", True, None],
    "frequency_penalty": [-2.1, 2.1, NAN, True, None],
    "repetition_penalty": [0.0, -1.0, NAN, INF, "1", True, None],
    "logit_bias": [{-1: 1.0}, {1: 101.0}, {1: NAN}, {True: 1.0}, {"1": 1.0}, {1: "x"}, [1], "x", {1: None},
                   {2**63: 1.0}, {i: 1.0 for i in range(sp.MAX_LOGIT_BIAS + 1)}],
    "bad_words": ["abc", [1], ["a", None], 5, ("a",), ["\ud800"], ["w"] * (sp.MAX_BAD_WORDS + 1),
                  ["w" * (sp.MAX_BAD_WORD_CHARS + 1)]],
    "priority": [2**31, -(2**31) - 1, 1.5, True, "1", None],
    "structured_outputs": [{"json": {}}, "regex", 1],
}
CASES = [(name, value) for name, values in BAD_VALUES.items() for value in values]


def _case_id(name: str, value) -> str:
    text = repr(value)
    return f"{name}={text if len(text) < 40 else text[:30] + f'...({len(value)})'}"


def test_every_field_is_covered():
    assert set(BAD_VALUES) == set(SamplingParams.__struct_fields__)


@pytest.mark.parametrize("name, value", CASES, ids=[_case_id(n, v) for n, v in CASES])
def test_bad_value_is_refused_with_the_field_named(name, value):
    field = "min_tokens" if name == "min_tokens" and value == 17 else name
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{name: value})
    with pytest.raises(ValueError, match=field):
        SamplingParams().clone(**{name: value})
    params = SamplingParams()
    setattr(params, name, value)  # a change in place is caught by verify(), which submission calls
    with pytest.raises(ValueError, match=field):
        params.verify()


def test_good_values_and_normalization():
    p = SamplingParams(stop="x", top_k=-1, output_kind=1, seed=-(2**63), priority=2**31 - 1,
                       logit_bias={3: -100.0}, bad_words=["a b"], stop_token_ids=[0, 5], temperature=0)
    assert p.stop == ["x"] and p.top_k == 0 and p.output_kind is RequestOutputKind.DELTA and p.greedy
    assert SamplingParams(max_tokens=None, min_tokens=10**6).max_tokens is None
    assert SamplingParams(stop=["\u00e9\u4e2d\U0001f600"]).stop  # any valid unicode is fine
    clone = p.clone(max_tokens=3)
    assert clone.max_tokens == 3 and p.max_tokens == 16  # clone leaves the original alone


def test_wire_round_trip_validates():
    """What the engine decodes is validated again: a bad payload is refused there too."""
    p = SamplingParams(stop=["a"], temperature=0.5)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p
    raw = msgspec.msgpack.encode({"temperature": -1.0})
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        msgspec.msgpack.decode(raw, type=SamplingParams)


def test_public_name():
    assert vx.SamplingParams is SamplingParams


def test_structured_outputs_params_need_exactly_one_constraint():
    from vx.sampling_params import StructuredOutputsParams

    for bad in ({}, {"regex": "a", "choice": ["x"]}, {"json": 3}, {"regex": ""}, {"choice": []},
                {"choice": ["a", 1]}, {"grammar": 5}, {"json_object": 1}, {"structural_tag": ""},
                {"structural_tag": "{}", "regex": "a"}):
        with pytest.raises(ValueError, match="json|regex|choice|grammar|structural_tag"):
            StructuredOutputsParams(**bad)
    so = StructuredOutputsParams(choice=["yes", "no"])
    assert so.kind == "choice" and StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(structural_tag='{"type": "structural_tag"}').kind == "structural_tag"
    params = SamplingParams(structured_outputs=so)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert wire.structured_outputs == so


def test_bounds_are_inclusive():
    """Each bound itself is allowed: a request at the limit is served, one past it is refused."""
    SamplingParams(n=2**63 - 1, top_k=2**63 - 1, max_tokens=2**63 - 1, min_tokens=2**63 - 1,
                   logprobs=sp.MAX_LOGPROBS, prompt_logprobs=sp.MAX_LOGPROBS,
                   stop=["s" * sp.MAX_STOP_STRING_CHARS] * sp.MAX_STOP_STRINGS,
                   stop_token_ids=[2**63 - 1] * sp.MAX_STOP_TOKEN_IDS,
                   logit_bias={i: 1.0 for i in range(sp.MAX_LOGIT_BIAS)},
                   bad_words=["w" * sp.MAX_BAD_WORD_CHARS] * sp.MAX_BAD_WORDS)
    with pytest.raises(ValueError, match="min_tokens must be <= 9223372036854775807"):
        SamplingParams(max_tokens=None, min_tokens=2**63)


def test_stop_strings_and_bad_words_are_bounded_for_every_caller():
    """What a hostile request sent (64 stop strings of 1 KiB, 1,024 bad words of 1 KiB) is refused by count and by
    length: the engine's per-token work grows with both."""
    bounds = (sp.MAX_STOP_STRINGS, sp.MAX_STOP_STRING_CHARS, sp.MAX_BAD_WORDS, sp.MAX_BAD_WORD_CHARS)
    assert bounds == (32, 256, 256, 128)
    with pytest.raises(ValueError, match="stop has 64 entries; at most 32 are allowed"):
        SamplingParams(n=128, stop=["x" * 1024] * 64)
    with pytest.raises(ValueError, match="stop entry of 1024 characters is too long; at most 256"):
        SamplingParams(stop=["x" * 1024])
    with pytest.raises(ValueError, match="bad_words has 1024 entries; at most 256 are allowed"):
        SamplingParams(bad_words=["w"] * 1024)
    with pytest.raises(ValueError, match="bad_words entry of 1024 characters is too long; at most 128"):
        SamplingParams(bad_words=["w" * 1024])
    params = SamplingParams(stop=["x"])
    params.stop = ["x"] * 33  # changed in place: the next verify (as the engine's front end runs it) refuses it
    with pytest.raises(ValueError, match="stop has 33 entries"):
        params.verify()


def test_int64_bound_holds_on_the_wire():
    """A uint64 from a foreign client is refused when the engine decodes it, not turned into a tensor."""
    raw = msgspec.msgpack.encode({"top_k": 2**63})
    with pytest.raises(msgspec.ValidationError, match="top_k"):
        msgspec.msgpack.decode(raw, type=SamplingParams)


def test_verify_for_model_bounds_top_k_and_token_ids():
    SamplingParams(top_k=512, stop_token_ids=[511], logit_bias={0: 1.0}).verify_for_model(512)
    with pytest.raises(ValueError, match=r"top_k=513 exceeds the model's vocabulary size \(512\)"):
        SamplingParams(top_k=513).verify_for_model(512)
    with pytest.raises(ValueError, match=r"stop_token_ids entry 512 \(position 1\) is outside .*\[0, 512\)"):
        SamplingParams(stop_token_ids=[3, 512]).verify_for_model(512)
    with pytest.raises(ValueError, match="logit_bias key 2000"):
        SamplingParams(logit_bias={2000: 1.0}).verify_for_model(512)


def _enum_schema(num_values: int) -> dict:
    return {"type": "object", "properties": {"k": {"enum": [f"value-{i}" for i in range(num_values)]}}}


@pytest.mark.parametrize("make", [
    lambda: StructuredOutputsParams(json=_enum_schema(100_000)),  # ~1.3 MB
    lambda: StructuredOutputsParams(json=json.dumps(_enum_schema(100_000))),
    lambda: StructuredOutputsParams(regex="a" * (sp.MAX_STRUCTURED_OUTPUTS_BYTES + 1)),
    lambda: StructuredOutputsParams(grammar='root ::= "' + "\u00e9" * (sp.MAX_STRUCTURED_OUTPUTS_BYTES // 2) + '"'),
    lambda: StructuredOutputsParams(choice=["x" * 1000] * 200),
], ids=["json-dict", "json-text", "regex", "grammar-utf8", "choice-bytes"])
def test_structured_outputs_over_the_size_limit_are_refused(make):
    with pytest.raises(ValueError, match=rf"structured_outputs\.\w+ is \d+ bytes long; at most "
                                         rf"{sp.MAX_STRUCTURED_OUTPUTS_BYTES} bytes"):
        make()


def test_structured_outputs_size_bounds():
    StructuredOutputsParams(regex="a" * sp.MAX_STRUCTURED_OUTPUTS_BYTES)
    StructuredOutputsParams(choice=[str(i) for i in range(sp.MAX_CHOICES)])
    with pytest.raises(ValueError, match=f"choice has {sp.MAX_CHOICES + 1} entries; at most {sp.MAX_CHOICES}"):
        StructuredOutputsParams(choice=[str(i) for i in range(sp.MAX_CHOICES + 1)])
    StructuredOutputsParams(json={"default": {1, 2}})  # not JSON: left to the front end's check, which names it
