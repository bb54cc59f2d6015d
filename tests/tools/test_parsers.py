"""Tool-call parsers over real model output formats, whole and streamed in every split."""
from __future__ import annotations

import itertools
import json
import random

import pytest

from runlm.tools.parsers import (
    ForcedNamedParser,
    ForcedRequiredParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    parse_tool_calls,
    parser_for_template,
)
from runlm.tools.streaming import ToolCallStreamer

WEATHER = '{"city": "Paris", "units": {"temp": "C"}, "note": "a \\"quoted\\" } brace"}'
CASES = [
    (HermesParser(), f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
     "Let me check.\n", [("get_weather", WEATHER)]),
    (HermesParser(), ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
                     '{"arguments": {"x": [1, 2]}, "name": "b"}\n</tool_call>'),
     None, [("a", "{}"), ("b", '{"x": [1, 2]}')]),
    (Llama3JsonParser(), f'{{"name": "get_weather", "parameters": {WEATHER}}}', None, [("get_weather", WEATHER)]),
    (Llama3JsonParser(), '<|python_tag|>{"name": "a", "parameters": {"n": 1}}; {"name": "b", "parameters": {}}',
     None, [("a", '{"n": 1}'), ("b", "{}")]),
    (MistralParser(), (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, {{"name": "b", '
                      f'"arguments": {{}}}}]'), None, [("get_weather", WEATHER), ("b", "{}")]),
    (MistralParser(), f'[TOOL_CALLS]get_weather[ARGS]{WEATHER}', None, [("get_weather", WEATHER)]),
    (ForcedNamedParser("get_weather"), WEATHER, None, [("get_weather", WEATHER)]),
    (ForcedRequiredParser(), (f'[{{"name": "get_weather", "parameters": {WEATHER}}}, {{"name": "b", '
                             f'"parameters": {{"q": true}}}}]'), None, [("get_weather", WEATHER), ("b", '{"q": true}')]),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES, ids=[f"{c[0].name}-{i}" for i, c in enumerate(CASES)])
def test_whole_output_parses_to_content_and_calls(parser, text, content, calls) -> None:
    got_content, got = parse_tool_calls(parser, text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got) and len({c.id for c in got}) == len(got)
    assert all(isinstance(json.loads(c.arguments), dict) for c in got)


def _stream(parser, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    streamer = ToolCallStreamer(parser)
    content, calls = "", {}
    bounds = [0, *cuts, len(text)]
    for a, b in itertools.pairwise(bounds):
        c, deltas = streamer.push(text[a:b], final=b == len(text))
        content += c
        for d in deltas:
            if "id" in d:  # the first delta of a call carries id, type and name, and arguments ""
                assert d["index"] not in calls and d["type"] == "function" and d["function"]["arguments"] == ""
                calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("parser, text, content, calls", CASES, ids=[f"{c[0].name}-{i}" for i, c in enumerate(CASES)])
def test_streamed_deltas_reassemble_to_the_whole_result_for_any_split(parser, text, content, calls) -> None:
    streams_alike_in_every_split(parser, text, content, calls)


def streams_alike_in_every_split(parser, text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    """Streamed cut at every character, and at 20 random sets of six places: the whole answer each time."""
    rng = random.Random(len(text))
    splits = [list(range(1, len(text)))] + [sorted(rng.sample(range(1, len(text)), 6)) for _ in range(20)]
    for cuts in splits:
        got_content, got_calls = _stream(parser, text, cuts)
        assert (got_content if got_content.strip() else None) == content
        assert [(c["name"], c["arguments"]) for c in got_calls] == calls


def test_plain_answers_stay_content_even_while_they_look_like_a_marker() -> None:
    for parser in (HermesParser(), MistralParser(), Llama3JsonParser()):
        assert parse_tool_calls(parser, "The sky is blue.") == ("The sky is blue.", [])
    streamer = ToolCallStreamer(HermesParser())
    assert streamer.push("Use <tool") == ("Use ", [])  # might be <tool_call>: held back
    assert streamer.push("s> wisely", final=True) == ("<tools> wisely", [])


def test_malformed_or_unfinished_calls_come_back_as_content() -> None:
    for text in ('<tool_call>\n{"name": "a", "arguments": {"x": 1</tool_call>', '<tool_call>\nnot json\n</tool_call>',
                 '<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"name": "a", "arguments": [1]}'):
        assert parse_tool_calls(HermesParser(), text) == (text, [])


def test_arguments_given_as_a_json_string_are_unwrapped() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    _, calls = parse_tool_calls(HermesParser(), text)
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]
    assert _stream(HermesParser(), text, list(range(1, len(text))))[1] == [{"name": "f", "arguments": '{"a": 1}'}]


@pytest.mark.parametrize("template, name", [
    ("{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>", "hermes"),
    ("[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS][TOOL_CALLS]", "mistral"),
    ('{{- \'{"name": "\' + tool_call.name + \'", \' }}{{- \'"parameters": \' }}', "llama3_json"),
    (None, "hermes"),
])
def test_the_parser_follows_the_template(template, name) -> None:
    assert parser_for_template(template).name == name
