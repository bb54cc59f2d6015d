"""Chat templates render as transformers renders them, inside a sandbox."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from runlm.formats.chat_template import CHATML_TEMPLATE, ChatTemplateError, render_chat

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": "emoji 🙂 and\nnewlines\t tabs"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers_apply_chat_template(tiny_model, messages, add_generation_prompt) -> None:
    ref = AutoTokenizer.from_pretrained(str(tiny_model("llama")))
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = render_chat(messages, ref.chat_template, add_generation_prompt=add_generation_prompt,
                      bos_token=ref.bos_token, eos_token=ref.eos_token)
    assert got == expected


def test_template_variables_and_tools() -> None:
    template = ("{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}"
                "{% if tools %}{{ tools | tojson }}{% endif %}{% if add_generation_prompt %}>{% endif %}{{ eos_token }}")
    tools = [{"type": "function", "function": {"name": "f<&>", "parameters": {}}}]
    out = render_chat([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                      template, bos_token="<s>", eos_token="</s>", tools=tools)
    assert out == '<s>user:ab|[{"type": "function", "function": {"name": "f<&>", "parameters": {}}}]></s>'


def test_raise_exception_becomes_chat_template_error() -> None:
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        render_chat([{"role": "assistant", "content": "x"}], template)


def test_sandbox_blocks_attribute_escapes() -> None:
    with pytest.raises(ChatTemplateError):
        render_chat([{"role": "user", "content": "x"}], "{{ ''.__class__.__mro__[1].__subclasses__() }}")


def test_fallback_is_chatml() -> None:
    out = render_chat([{"role": "user", "content": "hello"}], None)
    assert out == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat([{"role": "user", "content": "hello"}], CHATML_TEMPLATE) == out
