"""Request handling without a server: chat message normalization, params mapping, logprobs shapes, metrics."""

from __future__ import annotations

import json

import pytest

from vx.outputs import EngineStats, Logprob
from vx.sampling_params import RequestOutputKind
from vx.serve.chat_prompt import prepare_chat
from vx.serve.errors import APIError
from vx.serve.logprobs import append_completion_logprobs, chat_logprobs
from vx.serve.metrics import RequestTimer, ServerMetrics
from vx.serve.params import sampling_params, structured_outputs
from vx.serve.protocol import ChatCompletionRequest, CompletionLogprobs, CompletionRequest, ToolDefinition

TOOLS = [ToolDefinition.model_validate({"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})]
TOOLS_TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
                  "{% for m in messages %}{{ m.role }}: {{ m.content }}"
                  "{% for c in m.tool_calls or [] %} CALL {{ c.function.name }}({{ c.function.arguments.city }})"
                  "{% endfor %}\n{% endfor %}")


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from vx.client.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def _render(tok, messages, tools=None, template=None) -> str:
    """What the server's renderer gets, rendered in-process (tests/serve/test_template_sandbox.py shows the
    renderer process renders the same)."""
    chat = prepare_chat(tok, messages, tools=tools, chat_template=template)
    return tok.apply_chat_template(chat.messages, tools=chat.tools, chat_template=chat.template, tokenize=False,
                                   add_generation_prompt=True)


def test_tools_go_into_the_system_message_of_a_template_without_tools(tok):
    text = _render(tok, [{"role": "user", "content": "Weather in Paris?"}], TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools")
    assert '"name": "get_weather"' in text and "<tool_call>" in text
    assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    with_system = _render(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], TOOLS)
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and with_system.count("system") == 1


def test_earlier_calls_and_null_content_render_in_any_template(tok):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "Paris?"}]},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = _render(tok, messages)
    assert "user\nWeather\nParis?<|im_end|>" in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in text
    assert "<|im_start|>tool\nsunny<|im_end|>" in text
    # A template that knows tools gets them, and the calls' arguments as a dict.
    text = _render(tok, messages, TOOLS, TOOLS_TEMPLATE)
    assert text.startswith("TOOLS:get_weather;") and "assistant:  CALL get_weather(Paris)" in text


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages.0.content"),
    ([{"content": "no role"}], "messages.0.role"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}],
     "messages.0.tool_calls"),
    ([{"role": "user", "content": 3}], "messages.0.content"),
])
def test_bad_messages_are_400s(tok, messages, param):
    with pytest.raises(APIError) as e:
        prepare_chat(tok, messages, tools=None, chat_template=None)
    assert e.value.status == 400 and e.value.param == param


def test_null_fields_are_dropped_as_transformers_does(tok):
    chat = prepare_chat(tok, [{"role": "user", "content": "Hi", "name": None}], tools=None, chat_template=None)
    assert chat.messages == [{"role": "user", "content": "Hi"}] and chat.template == tok.chat_template


def test_openai_fields_map_to_sampling_params():
    req = CompletionRequest.model_validate({
        "prompt": "x", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "END", "n": 1,
        "presence_penalty": 0.1, "frequency_penalty": 0.2, "logit_bias": {"5": -100, "7": 2.5}, "top_k": 4,
        "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True, "stop_token_ids": [9],
        "bad_words": ["bad"], "some_future_openai_field": True})
    p = sampling_params(req, max_tokens=req.max_tokens, logprobs=3)
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop, p.top_k, p.min_p) == \
        (7, 0.5, 0.9, 3, ["END"], 4, 0.05)
    assert p.logit_bias == {5: -100, 7: 2.5} and p.logprobs == 3 and p.ignore_eos and p.stop_token_ids == [9]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens) == (0.1, 0.2, 1.1, 2)
    assert p.output_kind == RequestOutputKind.DELTA and p.bad_words == ["bad"]
    defaults = sampling_params(CompletionRequest(prompt="x"), max_tokens=None)
    assert (defaults.temperature, defaults.top_p, defaults.max_tokens, defaults.n) == (1.0, 1.0, None, 1)


def test_output_constraints_and_their_conflicts():
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "response_format": {"type": "json_object"}})
    assert structured_outputs(chat, chat.response_format).json_object is True
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    assert structured_outputs(chat, chat.response_format).json == schema
    text = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "response_format": {"type": "text"}})
    assert structured_outputs(text, text.response_format) is None
    guided = CompletionRequest.model_validate({"prompt": "x", "guided_choice": ["yes", "no"]})
    assert structured_outputs(guided, None).choice == ["yes", "no"]
    extra = CompletionRequest.model_validate({"prompt": "x", "structured_outputs": {"json": json.dumps(schema)}})
    assert structured_outputs(extra, None).json == schema
    both = CompletionRequest.model_validate({"prompt": "x", "guided_regex": "a+", "structured_outputs": {"regex": "b"}})
    with pytest.raises(APIError, match="Only one output constraint"):
        structured_outputs(both, None)
    with pytest.raises(APIError, match="not valid JSON"):
        structured_outputs(CompletionRequest.model_validate({"prompt": "x", "guided_json": "{nope"}), None)


def test_logprobs_shapes(tok):
    positions = [{10: Logprob(-0.5, 1, "He"), 11: Logprob(-1.5, 2, "Ha")},
                 {12: Logprob(-3.0, 5, "llo"), 13: Logprob(-0.1, 1, "y"), 14: Logprob(-2.0, 2, "!")}]
    out = CompletionLogprobs()
    end = append_completion_logprobs(out, None, [10, 12], positions, offset=4)
    assert out.tokens == ["He", "llo"] and out.token_logprobs == [-0.5, -3.0] and out.text_offset == [4, 6]
    assert out.top_logprobs == [{"He": -0.5, "Ha": -1.5}, {"y": -0.1, "!": -2.0, "llo": -3.0}] and end == 9
    # the first prompt token has no logprob
    prompt = CompletionLogprobs()
    append_completion_logprobs(prompt, tok, [10], [None], 0)
    assert prompt.token_logprobs == [None] and prompt.top_logprobs == [None]
    assert prompt.tokens == [tok.decode([10])]  # no text from the engine: the tokenizer's
    entries = chat_logprobs(None, [10, 12], positions, top_n=1)
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in entries] == \
        [("He", -0.5, ["He"]), ("llo", -3.0, ["y"])]
    assert entries[1].bytes == list(b"llo")


def test_metrics_live_in_their_own_registry():
    a, b = ServerMetrics(), ServerMetrics()  # a global registry would refuse the second
    timer = RequestTimer(a, "/v1/completions", start=0.0)
    timer.prompt(7)
    timer.tokens(1, 1)
    timer.tokens(3, 3)
    timer.finished(["stop", "length"])
    a.update_engine(EngineStats(kv_blocks_total=8, kv_blocks_in_use=2, prefix_cache_queried_tokens=10,
                                prefix_cache_hit_tokens=4, num_running=1))
    text = a.render().decode()
    assert 'vx_prompt_tokens_total{endpoint="/v1/completions"} 7.0' in text
    assert 'vx_generation_tokens_total{endpoint="/v1/completions"} 4.0' in text
    assert 'vx_time_to_first_token_seconds_count{endpoint="/v1/completions"} 1.0' in text
    assert 'vx_inter_token_latency_seconds_count{endpoint="/v1/completions"} 3.0' in text
    assert 'vx_requests_total{endpoint="/v1/completions",finish_reason="stop"} 1.0' in text
    assert "vx_kv_cache_usage_ratio 0.25" in text and "vx_prefix_cache_hit_rate 0.4" in text
    assert "vx_num_requests_running 1.0" in text
    assert "vx_prompt_tokens_total{" not in b.render().decode()
