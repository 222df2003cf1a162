"""The chat-template renderer processes: the same text as transformers, escapes refused, every limit enforced."""

from __future__ import annotations

import os
import time

import anyio
import psutil
import pytest

from vx.serve.template_sandbox import TemplateLimits, TemplateRenderError, TemplateSandbox

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])]

# Uses what real templates use: special-token variables, namespace, tojson, loop controls, raise_exception,
# reversed messages, tools, trimming, and the `generation` tag of transformers' own extension.
RICH_TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages[::-1] %}
  {%- if m.role == 'user' and ns.last_user < 0 %}{% set ns.last_user = messages|length - 1 - loop.index0 %}{% endif %}
{%- endfor %}
{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% if not loop.last %},{% endif %}{% endfor %}</tools>
{%- endif %}
{%- for m in messages %}
  {%- if m.role == 'secret' %}{{ raise_exception('no secrets') }}{% endif %}
  {%- if m.role == 'skip' %}{% continue %}{% endif %}
  {{- '<|im_start|>' + m.role + '\n' }}
  {%- if m.role == 'assistant' %}
    {%- if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}
    {%- generation %}{{ m.content | trim }}{% endgeneration %}
  {%- else %}{{ m.content }}{% endif %}
  {%- if m.name is defined %} ({{ m.name }}){% endif %}
  {%- if loop.index0 == ns.last_user %} [last]{% endif %}
  {{- '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}
{{- eos_token if not add_generation_prompt else '' }}"""

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Héllo <|im_end|> {{ not a template }}", "name": "ada"},
            {"role": "skip", "content": "x"},
            {"role": "assistant", "content": "  Hi!  ", "reasoning_content": "think"},
            {"role": "user", "content": "Weather?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
# Loops that write nothing: pure time (loops that write also fill memory, and hit that limit first).
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from vx.client.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_dir)


async def _render(sb: TemplateSandbox, template: str, messages=USER, trusted: bool = False, **kw) -> str:
    kw.setdefault("tools", None)
    kw.setdefault("add_generation_prompt", True)
    kw.setdefault("variables", {})
    return await sb.render(template, messages, trusted=trusted, **kw)


async def test_renders_exactly_as_transformers(anyio_backend, tok):
    sb = TemplateSandbox()
    try:
        cases = [(tok.chat_template, MESSAGES[:2], None, True), (RICH_TEMPLATE, MESSAGES, None, True),
                 (RICH_TEMPLATE, MESSAGES, TOOLS, False), (RICH_TEMPLATE, MESSAGES[:2], TOOLS, True)]
        outs = []
        for template, messages, tools, gen in cases:
            want = tok.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                           add_generation_prompt=gen)
            outs.append(await sb.render(template, messages, tools=tools, add_generation_prompt=gen,
                                        variables=tok.special_tokens_map, trusted=False))
            assert outs[-1] == want
        rich = outs[2]  # the template did use what it was given
        assert rich.startswith(tok.bos_token) and rich.endswith(tok.eos_token) and "get_weather" in rich
        assert "Héllo" in rich and "<think>think</think>Hi!" in rich and rich.count("[last]") == 1
        with pytest.raises(TemplateRenderError, match="no secrets") as e:
            await _render(sb, RICH_TEMPLATE, [{"role": "secret", "content": ""}])
        assert e.value.limit is None
    finally:
        await sb.aclose()


ESCAPES = ["{{ ''.__class__.__mro__ }}", "{{ cycler.__init__.__globals__ }}", "{{ joiner.__init__.__globals__.os }}",
           "{{ namespace.__init__.__globals__ }}", "{% set n = namespace() %}{% set n.__class__ = 1 %}",
           "{{ messages.__class__.__subclasses__() }}", "{{ (messages|first).items.__self__.__class__.__base__ }}",
           "{{ dict.__call__.__globals__ }}", "{{ raise_exception.__globals__['__builtins__'] }}",
           "{{ ''|attr('__class__') }}", "{{ '{0.__class__.__mro__}'.format('') }}",
           "{{ lipsum.__globals__.os.popen('id').read() }}", "{{ self.__init__.__globals__ }}"]


async def test_escapes_are_refused(anyio_backend):
    """Each attempt either stops with jinja's SecurityError or reaches nothing (an undefined renders empty)."""
    sb = TemplateSandbox()
    try:
        for template in ESCAPES:
            try:
                out = await _render(sb, template)
            except TemplateRenderError as e:
                assert "SecurityError" in str(e) and e.limit is None, template
            else:
                assert out == "", (template, out)
    finally:
        await sb.aclose()


async def test_limits_are_enforced_and_overrunning_workers_replaced(anyio_backend):
    limits = TemplateLimits(timeout_s=1.0, max_output_chars=10_000, max_memory_mb=256, workers=2)
    sb = TemplateSandbox(limits)
    try:
        await _render(sb, "{{ 'warm' }}")
        first = {w.proc.pid for w in sb._live}
        start = time.monotonic()
        with pytest.raises(TemplateRenderError, match="took longer than 1 s") as e:
            await _render(sb, NESTED_LOOPS)
        assert e.value.limit == "timeout" and 1.0 <= time.monotonic() - start < 5.0
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in first)
        for template in ("{% set x = 'a' * 1000000000 %}{{ x|length }}", "{{ ''|center(1000000000) }}",
                         "{% set x = [0] * 1000000000 %}{{ x|length }}"):
            with pytest.raises(TemplateRenderError, match="more than 256 MiB") as e:
                await _render(sb, template)
            assert e.value.limit == "memory"
        with pytest.raises(TemplateRenderError, match="exceeds 10000 characters") as e:
            await _render(sb, "{% for i in range(20) %}{{ 'a' * 1000 }}{% endfor %}")
        assert e.value.limit == "output"
        assert await _render(sb, "{{ messages[0].content }}") == "hi"  # a fresh worker took over
        assert len(sb._live) <= limits.workers
        if os.path.exists("/proc/self/maps"):
            for w in sb._live:  # the renderer, like the server, never loads torch
                with open(f"/proc/{w.proc.pid}/maps") as f:
                    assert "libtorch" not in f.read()
    finally:
        await sb.aclose()
    assert not sb._live


async def test_request_templates_leave_a_renderer_to_the_servers_own(anyio_backend):
    sb = TemplateSandbox(TemplateLimits(timeout_s=1.0, workers=2))
    try:
        async with anyio.create_task_group() as tg:  # two renders at once: both renderers started
            for _ in range(2):
                tg.start_soon(_render, sb, "{{ 'warm' }}", USER, True)
        assert len(sb._idle) == 2
        trusted_took: list[float] = []

        async def trusted() -> None:
            await anyio.sleep(0.3)  # the request templates hold what they can by now
            start = time.monotonic()
            assert await _render(sb, "{{ 'ok' }}", trusted=True) == "ok"
            trusted_took.append(time.monotonic() - start)

        async def hostile() -> None:
            with pytest.raises(TemplateRenderError, match="took longer"):
                await _render(sb, NESTED_LOOPS)

        async with anyio.create_task_group() as tg:
            tg.start_soon(hostile)
            tg.start_soon(hostile)
            tg.start_soon(trusted)
        # Request templates get one renderer (one at a time); the other answered the server's template at once,
        # where sharing both would have kept it waiting for a timeout (1 s).
        assert trusted_took[0] < 0.5
    finally:
        await sb.aclose()


async def test_a_message_value_the_renderer_cannot_take_is_a_render_error(anyio_backend):
    """An int past 64 bits in a message (valid JSON, found by the schema fuzzer) cannot cross to a renderer: it is a
    TemplateRenderError (a 400 in the server), not an OverflowError (a 500)."""
    sandbox = TemplateSandbox(TemplateLimits(timeout_s=5.0, workers=1))
    try:
        with pytest.raises(TemplateRenderError, match="cannot be given"):
            await sandbox.render("{{ messages }}", [{"role": "user", "content": "hi", "x": -(2**63) - 1}], tools=None,
                                 add_generation_prompt=True, variables={}, trusted=True)
    finally:
        await sandbox.aclose()
