"""The tool-call formats of the 2025-2026 families (runlm/tools/formats.py), whole and streamed in every split, their
parameters typed by the tools' schemas, and each chosen from the chat template that teaches it."""
from __future__ import annotations

import json

import pytest

from runlm.tools.formats import (
    DeepSeekV3Parser,
    Glm45Parser,
    HarmonyParser,
    PythonicParser,
    Qwen3XmlParser,
    typed_value,
)
from runlm.tools.parsers import parse_tool_calls, parser_for_template
from tests.tools.test_parsers import streams_alike_in_every_split

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"},
    "opts": {"type": "object"}}}}}]
SCHEMAS = {"get_weather": TOOLS[0]["function"]["parameters"]["properties"]}
ARGS = '{"city": "Paris", "days": 3, "zip": "75001", "opts": {"unit": "C", "note": "a <b> c"}}'
BS, B, SEP, E, ES = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", \
    "<｜tool▁calls▁end｜>"
CASES = [
    (Qwen3XmlParser(SCHEMAS), ("Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                               "<parameter=days>\n3\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n"
                               '<parameter=opts>\n{"unit": "C", "note": "a <b> c"}\n</parameter>\n</function>\n'
                               "</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>"),
     "Let me look.\n", [("get_weather", ARGS), ("now", "{}")]),
    (Glm45Parser(SCHEMAS), ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>zip</arg_key>\n"
                            "<arg_value>75001</arg_value>\n<arg_key>opts</arg_key>\n"
                            '<arg_value>{"unit": "C", "note": "a <b> c"}</arg_value>\n</tool_call>'),
     None, [("get_weather", ARGS)]),
    (DeepSeekV3Parser(), (f"Sure.{BS}{B}function{SEP}get_weather\n```json\n{ARGS}\n```{E}"
                          f'{B}function{SEP}now\n```json\n{{}}\n```{E}{ES}'),
     "Sure.", [("get_weather", ARGS), ("now", "{}")]),
    (DeepSeekV3Parser(), f"{BS}{B}get_weather{SEP}{ARGS}{E}{ES}", None, [("get_weather", ARGS)]),  # V3.1
    (PythonicParser(), ('[get_weather(city="Paris", days=3, zip="75001", opts={"unit": "C", "note": "a <b> c"}), '
                        "now()]"), None, [("get_weather", ARGS), ("now", "{}")]),
    (PythonicParser(), '<|python_start|>[now(tz="Europe/Paris")]<|python_end|>', None, [("now", '{"tz": "Europe/Paris"}')]),
    (HarmonyParser(), ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" + ARGS),
     None, [("get_weather", ARGS)]),
    (HarmonyParser(), ("I'll check.<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
                       + ARGS), "I'll check.", [("get_weather", ARGS)]),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES, ids=[f"{c[0].name}-{i}" for i, c in enumerate(CASES)])
def test_whole_output_parses_to_content_and_calls(parser, text, content, calls) -> None:
    got_content, got = parse_tool_calls(parser, text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    assert all(isinstance(json.loads(c.arguments), dict) for c in got)


@pytest.mark.parametrize("parser, text, content, calls", CASES, ids=[f"{c[0].name}-{i}" for i, c in enumerate(CASES)])
def test_streamed_deltas_reassemble_to_the_whole_result_for_any_split(parser, text, content, calls) -> None:
    streams_alike_in_every_split(parser, text, content, calls)


def test_plain_answers_and_unfinished_calls_stay_content() -> None:
    for parser in (Qwen3XmlParser(), Glm45Parser(), DeepSeekV3Parser(), PythonicParser(), HarmonyParser()):
        assert parse_tool_calls(parser, "The sky is blue.") == ("The sky is blue.", [])
    for parser, text in [(Qwen3XmlParser(), "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>"),
                         (PythonicParser(), "[f(a=1), g("), (PythonicParser(), "[1, 2, 3]"),
                         (Glm45Parser(), "<tool_call>f\n<arg_key>a</arg_key>")]:
        assert parse_tool_calls(parser, text) == (text, [])


def test_text_parameters_are_typed_by_the_schema_or_read_as_json() -> None:
    assert typed_value("75001", {"type": "string"}) == "75001"
    assert typed_value("75001", {"type": "integer"}) == 75001
    assert typed_value("true", {"type": "boolean"}) is True and typed_value("yes", {"type": "boolean"}) == "yes"
    assert typed_value("75001", None) == 75001 and typed_value('"x"', None) == '"x"'
    assert typed_value("[1, 2]", None) == [1, 2] and typed_value("Paris", None) == "Paris"


@pytest.mark.parametrize("template, name", [
    ("<tool_call>\n<function={{ name }}>\n<parameter={{ key }}>", "qwen3_xml"),
    ("<tool_call>{{ tc.name }}<arg_key>{{ k }}</arg_key><arg_value>", "glm45"),
    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{{ tool['function']['name'] }}", "deepseek_v3"),
    ("[func_name1(params_name1=params_value1, params_name2=params_value2...)]", "pythonic"),
    ("<|start|>assistant<|channel|>commentary to=functions.{{ name }}", "harmony"),
])
def test_each_format_follows_its_template(template: str, name: str) -> None:
    assert parser_for_template(template, TOOLS).name == name
