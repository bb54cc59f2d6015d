"""Ollama's TEMPLATE language (Go's text/template): the interpreter's semantics one by one, and whole Ollama templates
rendered as Ollama renders them (its template.Execute: .Messages templates once, older .Prompt/.Response ones per
exchange and cut after the last .Response). Expected texts are written out by hand from Go's rules."""
from __future__ import annotations

from pathlib import Path

import pytest

from runlm.formats.chat_template import render_chat
from runlm.formats.go_template import GoStruct, GoTemplateError, go_json, looks_like_go, parse
from runlm.formats.template_limits import RenderLimitError, bounded_output
from runlm.formats.template_render import check_template

LLAMA31 = (Path(__file__).parent / "ollama_llama31.gotmpl").read_text().removesuffix("\n")  # Ollama's, as it stores it
CHATML = ("{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}{{ if .Prompt }}<|im_start|>user\n"
          "{{ .Prompt }}<|im_end|>\n{{ end }}<|im_start|>assistant\n{{ .Response }}<|im_end|>\n")


def render(source: str, data: object) -> str:
    return bounded_output(parse(source).generate(data), 5.0)


@pytest.mark.parametrize("source,data,want", [
    ("a {{- ' ' -}} b", {}, "a32b"),  # a character literal is Go's rune: it prints its code point
    ("a  {{- .X -}}  b", {"X": 1}, "a1b"),
    ("{{/* a comment */}}x{{- /* trimmed */ -}} y", {}, "xy"),
    ("{{ if .A }}a{{ else if .B }}b{{ else }}c{{ end }}", {"B": [1]}, "b"),
    ("{{ if and .A .B }}y{{ else }}n{{ end }}{{ or .A .C }}{{ or .B .C }}", {"A": 1, "B": "", "C": "c"}, "n1c"),
    ("{{ range $i, $m := .L }}{{ $i }}={{ $m.N }};{{ else }}none{{ end }}", {"L": [{"N": "a"}, {"N": "b"}]},
     "0=a;1=b;"),
    ("{{ range .L }}x{{ else }}none{{ end }}", {"L": []}, "none"),
    ("{{ range $k, $v := .M }}{{ $k }}{{ $v }}{{ end }}", {"M": {"b": 2, "a": 1}}, "a1b2"),  # map keys in order
    ("{{ range .L }}{{ if eq . 2 }}{{ break }}{{ end }}{{ . }}{{ end }}", {"L": [1, 2, 3]}, "1"),
    ("{{ range .L }}{{ if eq . 2 }}{{ continue }}{{ end }}{{ . }}{{ end }}", {"L": [1, 2, 3]}, "13"),
    ("{{ with .U }}{{ .Name }}{{ else }}anon{{ end }}", {"U": {"Name": "ann"}}, "ann"),
    ("{{ $x := 1 }}{{ if true }}{{ $x = 2 }}{{ end }}{{ $x }}", {}, "2"),
    ("{{ $last := eq (len (slice $.L 1)) 1 }}{{ $last }}", {"L": [1, 2]}, "true"),
    ("{{ index .L 1 }} {{ index .M \"k\" }} {{ .L | len }}", {"L": [5, 6], "M": {"k": "v"}}, "6 v 2"),
    ("{{ printf \"%s-%d-%q-%v\" \"a\" 3 \"b\" true }}", {}, 'a-3-"b"-true'),
    ("{{ print 1 2 \"x\" 3 }} {{ not 0 }} {{ ne 1 2 }} {{ lt 1 2 }} {{ ge \"b\" \"a\" }}", {}, "1 2x3 true true true true"),
    ("{{ .Missing }}", {}, "<no value>"),
    ("{{ json .M }}", {"M": {"b": "<", "a": [1.0, 2.5]}}, '{"a":[1,2.5],"b":"\\u003c"}'),
    ("{{ .F }} {{ 1e6 }} {{ 0.5 }} {{ 123456.5 }} {{ 0.00001 }} {{ -2.5e-7 }}", {"F": 3.0},
     "3 1e+06 0.5 123456.5 1e-05 -2.5e-07"),
    ('{{ "a\\tb" }}{{ `raw\\n` }}', {}, "a\tbraw\\n"),
])
def test_go_semantics(source: str, data: object, want: str) -> None:
    assert render(source, data) == want


def test_a_struct_prints_as_its_json_and_refuses_unknown_fields() -> None:
    tool = GoStruct({"Type": "function"}, {"type": "function", "function": {"name": "f"}})
    assert render("{{ . }} {{ .Type }}", tool) == '{"type":"function","function":{"name":"f"}} function'
    assert go_json([tool]) == '[{"type":"function","function":{"name":"f"}}]'
    with pytest.raises(GoTemplateError, match="can't evaluate field Nope"):
        render("{{ .Nope }}", tool)


@pytest.mark.parametrize("source,words", [
    ("{{ if .A }}x", "before the {{end}}"), ("x{{ end }}", "line 1: unexpected {{end}}"),
    ("a\nb\n{{ frobnicate .X }}", "line 3: function \"frobnicate\" not defined"),
    ("{{ define \"x\" }}{{ end }}", "not supported"), ("{{ (.A }}", "unclosed left paren"),
    ("{{ .A", "unclosed action"), ("{{ \"\\q\" }}", "unknown escape"), ("{{ }}", "missing value"),
])
def test_a_template_that_does_not_parse_says_where(source: str, words: str) -> None:
    with pytest.raises(GoTemplateError) as err:
        parse(source)
    assert words in str(err.value)


def test_exec_errors_and_limits() -> None:
    with pytest.raises(GoTemplateError, match="undefined variable"):
        render("{{ $nope }}", {})
    with pytest.raises(GoTemplateError, match="index out of range"):
        render("{{ index .L 5 }}", {"L": [1]})
    with pytest.raises(GoTemplateError, match="incompatible types"):
        render('{{ eq 1 "1" }}', {})
    with pytest.raises(RenderLimitError):
        render("{{ range .L }}{{ range $.L }}{{ range $.L }}{{ range $.L }}x{{ end }}{{ end }}{{ end }}{{ end }}",
               {"L": list(range(40))})
    with pytest.raises(RenderLimitError):
        render('{{ printf "%99999999s" "x" }}', {})


def test_go_and_jinja_templates_are_told_apart() -> None:
    assert looks_like_go(LLAMA31) and looks_like_go(CHATML) and looks_like_go("{{- range .Messages }}{{ end }}")
    jinja = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ '.' }}"
    assert not looks_like_go(jinja) and not looks_like_go("{{ bos_token }}{{ messages[0].content }}")
    assert not looks_like_go("{{ range(3) | list }}{{ if_x }}")
    check_template(LLAMA31)  # a server's --chat-template-file may be either
    with pytest.raises(GoTemplateError):
        check_template("{{ range .Messages }}")


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "a": 1}'}}]},
            {"role": "tool", "content": "20C", "tool_call_id": "c1"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "description": "City"}}, "required": ["city"]}}}]


def test_ollamas_llama31_template_with_tools() -> None:
    head = "<|start_header_id|>system<|end_header_id|>\n\nBe brief."
    assert render_chat(MESSAGES, LLAMA31, tools=TOOLS) == (
        head + "\n\nCutting Knowledge Date: December 2023\n\nWhen you receive a tool call response, use the output to "
        "format an answer to the orginal user question.\n\nYou are a helpful assistant with tool calling capabilities."
        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"a":1,"city":"Paris"}}<|eot_id|>'
        "<|start_header_id|>ipython<|end_header_id|>\n\n20C<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    # the last user turn with tools lists each tool's JSON, as Ollama's Tool.String() prints it
    asked = render_chat(MESSAGES[:2], LLAMA31, tools=TOOLS)
    assert ('{"type":"function","function":{"name":"get_weather","description":"Get weather","parameters":'
            '{"type":"object","required":["city"],"properties":{"city":{"type":"string","description":"City"}}}}}'
            "\n\nQuestion: Weather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n") in asked
    assert render_chat(MESSAGES[:2], LLAMA31) == (
        head + "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_an_older_template_renders_each_exchange_and_stops_where_the_answer_begins() -> None:
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}, {"role": "user", "content": "d"}]
    assert render_chat(chat, CHATML) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"
        "<|im_start|>user\nc\n\nd<|im_end|>\n<|im_start|>assistant\n")  # two user turns in a row: one, joined
    # a final assistant message is continued: the prompt ends inside it
    assert render_chat(chat[:3], CHATML).endswith("<|im_start|>assistant\nb")
