"""The checks on JSON a client sends (vx/serve/validation.py): nesting depth, lone surrogates, UTF-8, and JSON
schemas with their `$ref`s; and the server options' own validation."""

from __future__ import annotations

import json

import pytest

from vx.serve.errors import APIError
from vx.serve.options import ServerOptions
from vx.serve.params import structured_outputs
from vx.serve.protocol import CompletionRequest
from vx.serve.validation import check_json_schema, check_json_text, json_depth


@pytest.mark.parametrize("text, depth", [
    (b"1", 0), (b"[]", 1), (b'{"a": [1, {"b": []}]}', 4), (b'["[[[", "]]]{"]', 1),
    (b'{"a": "\\"[[", "b": [[1]]}', 3), (b"[" * 5000 + b"]" * 5000, 5000),
])
def test_json_depth_counts_brackets_outside_strings(text, depth):
    assert json_depth(text) == depth


def test_depth_limit_is_a_400():
    check_json_text(b"[" * 64 + b"]" * 64, 64)
    with pytest.raises(APIError) as e:
        check_json_text("[" * 65 + "]" * 65, 64, "messages[0].arguments", "messages.0")
    assert e.value.status == 400 and e.value.param == "messages.0" and "65 deep" in e.value.message


@pytest.mark.parametrize("text", [b'"\\ud800"', b'"a\\udc00"', b'{"\\uDBFF": 1}', '"\ud800"'])
def test_lone_surrogates_are_400(text):
    with pytest.raises(APIError, match="lone UTF-16 surrogate"):
        check_json_text(text, 64)


@pytest.mark.parametrize("text", [b'"\\ud83d\\ude00"', b'"\\\\ud800"', "\U0001F600".encode(), b"not json \\ud800"])
def test_pairs_escaped_backslashes_and_non_json_pass(text):
    check_json_text(text, 64)  # a pair is one character; "\\ud800" is text; non-JSON is the parser's to report


def test_bytes_that_are_not_utf8_are_400():
    with pytest.raises(APIError, match="not valid UTF-8"):
        check_json_text(b'"\xed\xa0\x80"', 64)  # a surrogate written as raw (CESU-8) bytes


@pytest.mark.parametrize("schema, fragment", [
    ({"type": "nonsense"}, "not a valid JSON schema at type"),
    ({"properties": {"a": {"$ref": "#/$defs/missing"}}}, "points nowhere"),
    ({"$ref": "https://example.com/schema.json"}, "points outside the schema"),
    ([{"type": "string"}], "a JSON schema is an object"),
])
def test_bad_schemas_are_400_naming_the_field(schema, fragment):
    with pytest.raises(APIError) as e:
        check_json_schema(schema, "response_format")
    assert e.value.status == 400 and e.value.param == "response_format" and fragment in e.value.message


def test_good_schemas_pass():
    check_json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}, "b": {"$ref": "#"}},
                       "$defs": {"a": {"type": "integer"}}}, "p")
    check_json_schema(True, "p")


def test_guided_json_as_text_is_bounded_and_checked():
    deep = json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
    req = CompletionRequest.model_validate({"prompt": "x", "guided_json": deep})
    with pytest.raises(APIError, match="points nowhere") as e:
        structured_outputs(req, None)
    assert e.value.param == "guided_json"
    req = CompletionRequest.model_validate({"prompt": "x", "guided_json": "[" * 100 + "]" * 100})
    with pytest.raises(APIError, match="100 deep"):
        structured_outputs(req, None, max_json_depth=64)


@pytest.mark.parametrize("field, value", [("max_body_bytes", 0), ("header_timeout", -1.0),
                                          ("max_concurrent_requests", True), ("body_timeout", "5")])
def test_options_refuse_values_that_are_not_positive_numbers(field, value):
    with pytest.raises(ValueError, match=field):
        ServerOptions(**{field: value})
