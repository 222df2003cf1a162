"""The reasoning parsers (vx/serve/reasoning.py): the think block goes to reasoning_content, streamed or not."""

from __future__ import annotations

import re

import openai
import pytest
from tests.support.server import MODEL, start_server, stop_server
from tests.support.tiny_tokenizer import CHATML_TEMPLATE

from vx.serve.reasoning import ReasoningSplitter, reasoning_enabled, starts_inside


@pytest.mark.parametrize("parser, opened, text, reasoning, content", [
    ("qwen3", False, "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "Paris."),
    ("qwen3", False, "Paris.", None, "Paris."),
    ("qwen3", False, "Paris. <think>no</think>", None, "Paris. <think>no</think>"),  # only a leading block
    ("qwen3", True, "Let me see.</think>Paris.", "Let me see.", "Paris."),  # the prompt opened the block
    ("qwen3", False, "<think>cut short by max_tok", "cut short by max_tok", None),
    ("deepseek_r1", False, "Hmm.</think>\n\nParis.", "Hmm.", "Paris."),
    ("deepseek_r1", False, "<think>Hmm.</think>Paris.", "Hmm.", "Paris."),
    ("deepseek_r1", False, "all reasoning, no end", "all reasoning, no end", None),
    ("qwen3", False, "<thi", None, "<thi"),
])
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_reply_splits_alike_whole_and_streamed(parser, opened, text, reasoning, content, step):
    inside = starts_inside(parser, opened, constrained=False)
    assert ReasoningSplitter(inside).split(text) == (reasoning, content)
    splitter = ReasoningSplitter(inside)
    parts = [splitter.feed(text[i:i + step]) for i in range(0, len(text), step)] + [splitter.finish()]
    assert "".join(r for r, _ in parts) == (reasoning or "") and "".join(c for _, c in parts) == (content or "")
    if step == 1 and reasoning and len(reasoning) > 8:  # reasoning streams as it comes, not at the end
        assert any(r for r, _ in parts[:len(text) // 2])


def test_thinking_turned_off_by_the_request():
    assert reasoning_enabled("qwen3", None) and reasoning_enabled("qwen3", {"other": 1})
    assert not reasoning_enabled("qwen3", {"enable_thinking": False})
    assert not reasoning_enabled("deepseek_r1", {"thinking": False}) and not reasoning_enabled(None, None)


def test_where_a_reply_starts():
    assert starts_inside("deepseek_r1", False, False) and starts_inside("qwen3", True, False)
    assert not starts_inside("qwen3", False, False)
    assert not starts_inside("deepseek_r1", True, True)  # a constrained reply: no block unless it writes <think>
    assert ReasoningSplitter(False).split('{"a": 1}') == (None, '{"a": 1}')
    with pytest.raises(ValueError, match="deepseek_r1"):
        starts_inside("nope", False, False)


# ChatML, with Qwen3's switch: thinking off writes an empty think block into the prompt; `open_think` opens one.
TEMPLATE = CHATML_TEMPLATE.replace(  # (the template's "\n" are newlines)
    "{{ '<|im_start|>assistant\n' }}",
    "{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% if open_think %}{{ '<think>\\n' }}{% endif %}")
MESSAGES = [{"role": "user", "content": "Hi"}]
THINK = r"<think>[a-z]{3,6}</think>\n\n[a-z]{2,4}"  # what the model is made to write


@pytest.fixture(scope="module")
def thinking(tiny_model_dir, tmp_path_factory):
    """An `openai` client of a server with the qwen3 reasoning parser and the template above."""
    import openai

    folder = tmp_path_factory.mktemp("reasoning")
    (folder / "template.jinja").write_text(TEMPLATE)
    srv = start_server(tiny_model_dir, str(folder / "server.log"), "--reasoning-parser", "qwen3",
                       "--chat-template", str(folder / "template.jinja"), "--served-model-name", MODEL)
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
    stop_server(srv)


def _ask(client, regex=THINK, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                          extra_body={"structured_outputs": {"regex": regex}, **kwargs.pop("extra", {})},
                                          **kwargs)


def test_the_think_block_is_reasoning_content(thinking):
    msg = _ask(thinking).choices[0].message
    assert re.fullmatch(r"[a-z]{3,6}", msg.reasoning_content) and re.fullmatch(r"[a-z]{2,4}", msg.content)
    chunks = list(_ask(thinking, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == msg.reasoning_content
    assert "".join(d.content or "" for d in deltas) == msg.content


def test_chat_template_kwargs_reach_the_template_and_the_parser(thinking):
    default = _ask(thinking)
    off = _ask(thinking, extra={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > default.usage.prompt_tokens  # the empty block is in the prompt
    assert off.choices[0].message.reasoning_content is None and off.choices[0].message.content.startswith("<think>")
    opened = _ask(thinking, regex=r"[a-z]{3,6}</think>[a-z]{2,4}", extra={"chat_template_kwargs": {"open_think": True}})
    assert opened.choices[0].message.reasoning_content and "</think>" not in opened.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        _ask(thinking, extra={"chat_template_kwargs": {"messages": []}})
    assert e.value.body["param"] == "chat_template_kwargs"


def test_a_json_reply_is_content_even_when_the_prompt_opened_a_block(thinking):
    out = thinking.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                           response_format={"type": "json_object"},
                                           extra_body={"chat_template_kwargs": {"open_think": True}})
    msg = out.choices[0].message
    assert msg.reasoning_content is None and msg.content.startswith("{")
