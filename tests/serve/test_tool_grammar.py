"""The output constraint of `tool_choice="auto"` (vx/serve/tool_grammar.py), compiled by xgrammar as the engine
compiles it: content that fits `response_format` or tool calls; `strict` tools' arguments fit their parameters."""

from __future__ import annotations

import pytest

from vx.serve.protocol import ResponseFormat, ToolDefinition
from vx.serve.tool_grammar import auto_tool_constraint

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "London"]}}, "required": ["city"]}
FORMAT = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "v", "schema": {
    "type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}}})
CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def _tools(strict):
    return [ToolDefinition.model_validate({"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER, "strict": strict}})]


@pytest.fixture(scope="module")
def accepts(tiny_model_dir):
    """accepts(constraint, text): whether the compiled constraint takes `text` as a whole reply."""
    xgr = pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(tiny_model_dir)))

    def check(constraint, text):
        matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(constraint.structural_tag))
        return matcher.accept_string(text) and (matcher.is_terminated() or matcher.accept_token(0))
    return check


def test_no_constraint_without_a_format_or_a_strict_tool():
    assert auto_tool_constraint(_tools(None), None) is None
    assert auto_tool_constraint(_tools(False), ResponseFormat(type="text")) is None


@pytest.mark.parametrize("text, ok", [
    ('{"answer": "yes"}', True), ('{"answer": "maybe"}', False), ("Hello", False),
    (CALL.format(name="get_weather", args='{"city": "Paris"}'), True),
    (CALL.format(name="get_weather", args='{"city": "Rome"}'), True),  # not strict: any object
    (CALL.format(name="launch", args="{}"), False),
])
def test_a_response_format_with_tools_is_content_or_calls(accepts, text, ok):
    assert accepts(auto_tool_constraint(_tools(None), FORMAT), text) is ok


@pytest.mark.parametrize("text, ok", [
    ("Any text at all.", True),
    ("Let me look. " + CALL.format(name="get_weather", args='{"city": "London"}'), True),
    (CALL.format(name="get_weather", args='{"city": "Rome"}'), False),  # strict: must fit the parameters
])
def test_a_strict_tool_constrains_its_calls_only(accepts, text, ok):
    assert accepts(auto_tool_constraint(_tools(True), None), text) is ok
