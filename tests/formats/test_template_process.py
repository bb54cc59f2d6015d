"""Chat templates render in worker processes with a memory and CPU limit (issue 33): the string-growing C
calls the sandbox cannot see (str.replace, |replace, ~, join, tojson(indent=...)) fail there, quickly,
without the caller's memory growing; real templates render exactly as transformers renders them."""
from __future__ import annotations

import resource
import threading
import time

import pytest
from transformers import AutoTokenizer

from runlm.formats import template_process
from runlm.formats.chat_template import ChatTemplateError, ChatTemplateLimitError, render_chat, render_in_process
from runlm.formats.gguf import GGUFFile
from tests.fixtures.models import smollm2_gguf

BOMBS = {
    "str.replace": "{% set s = 'x' * 1000000 %}{{ s.replace('x', 'y' * 4000)|length }}",
    "|replace": "{% set s = 'x' * 1000000 %}{{ (s|replace('x', 'y' * 3000))|length }}",
    "~": "{% set ns = namespace(s='x' * 30000000) %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
         "{% endfor %}{{ ns.s|length }}",
    "join": "{% set l = ['y' * 20000000] * 200 %}{{ l|join('')|length }}",
    "tojson(indent)": "{% set l = [[[[[[1]*30]*30]*30]*30]] %}{{ (l|tojson(indent=200))|length }}",
    "many values": "{% set ns = namespace(l=[]) %}{% for i in range(200) %}"
                   "{% set ns.l = ns.l + [('z' * 30000000) ~ i] %}{% endfor %}{{ ns.l|length }}",
}
HI = [{"role": "user", "content": "hi"}]

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>'"
          " + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
          "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
    {%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather <&> in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CONVERSATION = [{"role": "system", "content": "Be brief. 🙂"}, {"role": "user", "content": " 2+2?\n"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]


@pytest.mark.parametrize("name", ["smollm2", "llama3", "qwen2.5"])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_real_templates_render_as_transformers_does(tiny_model, name: str, tools: list | None) -> None:
    ref = AutoTokenizer.from_pretrained(str(tiny_model("llama")))
    template = {"smollm2": str(GGUFFile(smollm2_gguf()).get("tokenizer.chat_template")), "llama3": LLAMA3,
                "qwen2.5": QWEN25}[name]
    expected = ref.apply_chat_template(CONVERSATION, chat_template=template, tools=tools, tokenize=False,
                                       add_generation_prompt=True)
    got = render_chat(CONVERSATION, template, bos_token=ref.bos_token, eos_token=ref.eos_token, tools=tools)
    assert got == expected


@pytest.mark.parametrize("name", BOMBS)
def test_a_bomb_fails_in_its_worker_not_here(name: str) -> None:
    render_chat(HI, None)  # a warm worker
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(ChatTemplateLimitError, match="memory limit"):
        render_chat(HI, BOMBS[name])
    assert time.monotonic() - start < 3  # in process: 1-13 s of one C call, 2-5.5 GB
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB: this process never grew
    assert render_chat(HI, None).startswith("<|im_start|>user")  # a fresh worker takes over


def test_a_worker_past_its_time_is_killed_and_others_render_meanwhile() -> None:
    # a C call the in-process deadline never sees: a huge integer power
    errors: list[BaseException] = []

    def spin() -> None:
        try:
            render_chat(HI, "{{ ((10**4096)**4096)**4096 }}")
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    start = time.monotonic()
    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.3)
    for _ in range(20):  # the other workers answer at once meanwhile
        t0 = time.monotonic()
        assert "hello" in render_chat([{"role": "user", "content": "hello"}], None)
        assert time.monotonic() - t0 < 1.0
    t.join(30)
    assert time.monotonic() - start < template_process.KILL_AFTER + 2
    assert len(errors) == 1 and isinstance(errors[0], ChatTemplateLimitError), errors
    assert "too long" in str(errors[0])


def test_a_worker_that_dies_is_replaced() -> None:
    render_chat(HI, None)
    dead = list(template_process._pool.idle)
    for w in dead:
        w.proc.kill()
        w.proc.wait()
    assert render_chat(HI, None).endswith("<|im_start|>assistant\n")
    assert not set(dead) & set(template_process._pool.idle)


def test_template_errors_and_inputs_keep_their_types() -> None:
    with pytest.raises(ChatTemplateError, match="must alternate"):
        render_chat(HI, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TypeError):
        render_chat(HI, None, extra=threading.Lock())  # not plain data
    assert render_chat(HI, "{{ x }}", x="given") == render_in_process("{{ x }}", {"x": "given"}) == "given"
