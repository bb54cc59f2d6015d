"""Ollama's Modelfile read as Ollama reads it, and written back by ``show --modelfile`` so it reads the same."""
from __future__ import annotations

import pytest

from runlm.formats.modelfile import ChatDefaults, ModelfileError, modelfile_text, parse_modelfile

TEXT = '''# a comment
FROM smollm2
parameter temperature 0.2
PARAMETER num_ctx 4096
PARAMETER stop "<|im_end|>"
PARAMETER stop "User:"
TEMPLATE """{{ if .System }}S: {{ .System }}
{{ end }}U: {{ .Prompt }}
A: {{ .Response }}"""
SYSTEM You are "terse".
MESSAGE user Is the sky blue?
MESSAGE assistant "Yes, \\"very\\"."
ADAPTER ./lora.gguf
LICENSE """MIT
text"""
'''


def test_every_instruction() -> None:
    mf = parse_modelfile(TEXT)
    assert mf.base == "smollm2"
    assert mf.parameters == {"temperature": 0.2, "num_ctx": 4096, "stop": ["<|im_end|>", "User:"]}
    assert mf.template == "{{ if .System }}S: {{ .System }}\n{{ end }}U: {{ .Prompt }}\nA: {{ .Response }}"
    assert mf.system == 'You are "terse".'
    assert mf.messages == [{"role": "user", "content": "Is the sky blue?"},
                           {"role": "assistant", "content": 'Yes, "very".'}]
    assert mf.adapters == ["./lora.gguf"] and mf.license == ["MIT\ntext"]


def test_what_show_writes_reads_back_the_same() -> None:
    mf = parse_modelfile(TEXT)
    again = parse_modelfile(modelfile_text("smollm2", mf.parameters, mf.template, mf.system, mf.messages, mf.license))
    assert (again.base, again.parameters, again.template, again.system, again.messages, again.license) == (
        mf.base, mf.parameters, mf.template, mf.system, mf.messages, mf.license)


@pytest.mark.parametrize("text,words", [
    ("FROM x\nPARAMETER temperature 1\nFRM y\n", "line 3: unknown instruction 'FRM'"),
    ("PARAMETER temperature 1\n", "no FROM line"),
    ("FROM x\nMESSAGE robot hi\n", "line 2: MESSAGE role 'robot'"),
    ("FROM x\nSYSTEM \"\"\"never closed\n", "line 2: unterminated"),
    ("FROM x\nPARAMETER\n", "line 2: PARAMETER needs a name and a value"),
    ('FROM x\nSYSTEM "a" b\n', "line 2: unexpected 'b'"),
])
def test_a_bad_modelfile_names_its_line(text: str, words: str) -> None:
    with pytest.raises(ModelfileError) as err:
        parse_modelfile(text)
    assert words in str(err.value)


def test_chat_defaults_go_around_the_conversation_as_ollamas() -> None:
    d = ChatDefaults("sys", ({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}))
    asked = [{"role": "user", "content": "hi"}]
    assert d.chat(asked) == [{"role": "system", "content": "sys"}, *d.messages, *asked]
    own = [{"role": "system", "content": "mine"}, *asked]  # a request's own system prompt wins
    assert d.chat(own) == [*d.messages, *own]
