"""SamplingParams validation: every field refuses values out of range and of the wrong type with a ValueError
that names the field, at construction, in `clone`, and (through `verify`) after a change in place."""

from __future__ import annotations

import msgspec
import pytest

import vx
from vx.sampling_params import RequestOutputKind, SamplingParams

NAN, INF = float("nan"), float("inf")

# field -> values it must refuse. Every field of SamplingParams appears (a test checks it).
BAD_VALUES: dict[str, list] = {
    "n": [0, -1, 1.0, True, "1", None],
    "temperature": [-0.1, NAN, INF, "0", True, None],
    "top_p": [0.0, 1.1, -1, NAN, "1", True, None],
    "top_k": [-2, -1.0, 1.5, True, "3", None],
    "min_p": [-0.1, 1.1, NAN, "0", True, None],
    "seed": [2**63, -(2**63) - 1, 1.5, True, "1"],
    "max_tokens": [0, -1, 1.5, True, "16"],
    "min_tokens": [-1, 1.5, True, "1", None, 17],  # 17 > max_tokens (16)
    "stop": [[""], [1], ["a", None], 5, ("a",), b"x", "\ud800", ["ok", "\udfff"], {"a"}],
    "stop_token_ids": [[-1], [1.0], [True], 3, "1", (1, 2), [None]],
    "ignore_eos": [1, 0, "yes", None],
    "skip_special_tokens": [1, None],
    "spaces_between_special_tokens": [0, None],
    "include_stop_str_in_output": [1, None],
    "output_kind": [5, -1, "delta", True, None, 1.0],
    "logprobs": [-1, 1.5, True, "1"],
    "prompt_logprobs": [-1, 1.5, True],
    "presence_penalty": [-2.1, 2.1, NAN, INF, "0", True, None],
    "frequency_penalty": [-2.1, 2.1, NAN, True, None],
    "repetition_penalty": [0.0, -1.0, NAN, INF, "1", True, None],
    "logit_bias": [{-1: 1.0}, {1: 101.0}, {1: NAN}, {True: 1.0}, {"1": 1.0}, {1: "x"}, [1], "x", {1: None}],
    "bad_words": ["abc", [1], ["a", None], 5, ("a",), ["\ud800"]],
    "priority": [2**31, -(2**31) - 1, 1.5, True, "1", None],
    "structured_outputs": [{"json": {}}, "regex", 1],
}
CASES = [(name, value) for name, values in BAD_VALUES.items() for value in values]


def test_every_field_is_covered():
    assert set(BAD_VALUES) == set(SamplingParams.__struct_fields__)


@pytest.mark.parametrize("name, value", CASES, ids=[f"{n}={v!r}" for n, v in CASES])
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
                {"choice": ["a", 1]}, {"grammar": 5}, {"json_object": 1}):
        with pytest.raises(ValueError, match="json|regex|choice|grammar"):
            StructuredOutputsParams(**bad)
    so = StructuredOutputsParams(choice=["yes", "no"])
    assert so.kind == "choice" and StructuredOutputsParams(json_object=True).kind == "json_object"
    params = SamplingParams(structured_outputs=so)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert wire.structured_outputs == so
