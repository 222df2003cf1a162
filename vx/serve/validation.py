"""Checks of what a client sends that the request models cannot express, each failing as a 400 that says why.

- `check_json_text`: a body (or a JSON text inside one, such as tool-call arguments) must be UTF-8, nest at
  most `max_depth` arrays/objects deep (deeper input makes parsers, templates and the grammar compiler recurse
  until they fail), and hold no lone UTF-16 surrogate (`"\\ud800"`: no tokenizer can encode it).
- `check_json_schema`: a JSON schema (response_format, tool parameters, guided_json) must be valid against its
  metaschema, and each `$ref` must point to a place inside it.

They run before the request costs anything else; the body check works on the raw bytes at C speed.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterator

import numpy as np

from vx.serve.errors import APIError, bad_request

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escapes included (unrolled: no backtracking)
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_DEPTH_STEP = np.zeros(256, dtype=np.int8)
_DEPTH_STEP[list(b"[{")] = 1
_DEPTH_STEP[list(b"]}")] = -1
# A surrogate written as an escape (`\ud800`); raw surrogate bytes are not UTF-8 and fail the decode.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def json_depth(text: bytes) -> int:
    """How deep arrays and objects nest in the JSON `text` (brackets inside strings do not count)."""
    brackets = _STRING.sub(b"", text).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    steps = _DEPTH_STEP[np.frombuffer(brackets, dtype=np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max())


def check_json_text(text: bytes | str, max_depth: int, what: str = "The request body",
                    param: str | None = None) -> None:
    """A 400 if the JSON `text` is not UTF-8, nests deeper than `max_depth`, or holds a lone surrogate.

    Text that is not JSON at all passes: the parser that reads it next reports that.
    """
    if isinstance(text, str):
        try:
            raw = text.encode("utf-8")
        except UnicodeEncodeError:
            raise _surrogate(what, param) from None
    else:
        raw = text
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise bad_request(f"{what} is not valid UTF-8 (byte {e.start}).", param) from None
    depth = json_depth(raw)
    if depth > max_depth:
        raise bad_request(f"{what} nests arrays and objects {depth} deep; at most {max_depth} levels are "
                          "accepted.", param)
    if _SURROGATE_ESCAPE.search(raw) is not None and _has_lone_surrogate(raw):
        raise _surrogate(what, param)


def _has_lone_surrogate(raw: bytes) -> bool:
    # Pairs of escapes make one valid character; only the parsed text tells a lone one apart.
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return False  # not JSON: its parser reports that
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _surrogate(what: str, param: str | None) -> APIError:
    return bad_request(f"{what} holds a lone UTF-16 surrogate (such as \\ud800), which is not valid Unicode "
                       "text.", param)


def check_json_schema(schema: Any, param: str) -> None:
    """A 400 naming `param` unless `schema` is a valid JSON schema whose `$ref`s all resolve inside it."""
    import jsonschema
    from referencing import Registry, Resource
    from referencing.exceptions import Unresolvable
    from referencing.jsonschema import DRAFT202012

    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{param}: a JSON schema is an object, got {type(schema).__name__}.", param)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise bad_request(f"{param}: not a valid JSON schema{f' at {where}' if where else ''}: {e.message}",
                          param) from None
    if not isinstance(schema, dict):
        return
    resolver = Registry().with_resource("urn:vx:schema", Resource.from_contents(
        schema, default_specification=DRAFT202012)).resolver(base_uri="urn:vx:schema")
    for ref in _refs(schema):
        if not ref.startswith("#"):
            raise bad_request(f"{param}: $ref {ref!r} points outside the schema; only references inside it "
                              "(#/...) are supported.", param)
        try:
            resolver.lookup(ref)
        except Unresolvable:
            raise bad_request(f"{param}: $ref {ref!r} points nowhere in the schema.", param) from None


def _refs(node: Any) -> Iterator[str]:
    stack = [node]
    while stack:  # iterative: the depth is bounded already, but no recursion is cheaper still
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str):
                yield ref
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
