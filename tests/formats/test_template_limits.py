"""Chat templates render within a deadline and a size (issue 15 #3): each attack stops with a clear error,
before it takes the memory it asks for; ordinary templates and messages render as before."""
from __future__ import annotations

import time

import pytest

from runlm.formats.chat_template import ChatTemplateError, render_chat
from runlm.formats.template_limits import RENDER_SECONDS

MSGS = [{"role": "user", "content": "a phone 12345678, 50% off, {braces} and {:>99999999}"}]


@pytest.mark.parametrize("template, text", [
    ("{{ 'x' * 10**11 }}", "would build"),
    ("{{ [1] * 10**11 }}", "would build"),
    ("{{ 'x' | center(10**11) }}", "passes"),
    ("{{ 'x'.ljust(10**11) }}", "passes"),
    ("{{ '%99999999s' % 'x' }}", "width"),
    ("{{ '{:>99999999}'.format('x') }}", "width"),
    ("{{ 7 ** 100000 }}", "power"),
    ("{% set ns = namespace(s='xx') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "would build"),
    ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "would build"),
    ("{{ range(10**7) | list }}", "range"),
])
def test_what_would_exhaust_memory_is_refused_at_once(template: str, text: str) -> None:
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=text):
        render_chat(MSGS, template)
    assert time.monotonic() - start < 2


def test_nested_loops_stop_at_the_deadline() -> None:
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="too long"):
        render_chat(MSGS, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    assert time.monotonic() - start < RENDER_SECONDS + 1


def test_ordinary_templates_and_messages_are_untouched() -> None:
    out = render_chat(MSGS, None)
    assert MSGS[0]["content"] in out
    fancy = "{% for m in messages %}{{ '%-6s' % m.role }}{{ '{}: {}'.format(m.role, m.content) | trim }}{% endfor %}"
    assert render_chat(MSGS, fancy) == "user  user: " + MSGS[0]["content"]
