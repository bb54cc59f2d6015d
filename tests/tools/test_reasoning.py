"""Reasoning parsers: thinking split from the answer, whole or in pieces of any size (tags straddling them)."""
from __future__ import annotations

import pytest

from runlm.tools.reasoning import REASONING_PARSERS, ReasoningSplitter, parser_for_template, split_reasoning

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]

CASES = [  # (parser, prompt opened thinking, output, thinking, content)
    (QWEN3, False, "<think>\nLet me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
    (QWEN3, False, "Paris.", None, "Paris."),
    (QWEN3, False, "  \n<think>a</think>b", "a", "b"),
    (QWEN3, False, "<thinking is fun", None, "<thinking is fun"),
    (QWEN3, True, "Let me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
    (QWEN3, True, "cut short by max_tokens  \n", "cut short by max_tokens", ""),
    (QWEN3, True, "a </thin b</think>c </think> d", "a </thin b", "c </think> d"),
    (QWEN3, False, "<think>\n\n</think>\n\nParis.", "", "Paris."),
    (R1, True, "no opening tag</think>answer", "no opening tag", "answer"),
    (QWEN3, False, "<think>x</think>\n\n<tool_call>{}</tool_call>", "x", "<tool_call>{}</tool_call>"),
]


@pytest.mark.parametrize(("parser", "inside", "text", "thinking", "content"), CASES)
def test_whole_and_in_pieces_agree(parser, inside, text, thinking, content) -> None:
    assert split_reasoning(parser, inside, text) == (thinking, content)
    for size in (1, 2, 3, 5):
        splitter = ReasoningSplitter(parser, inside)
        pieces = [splitter.push(text[i:i + size]) for i in range(0, len(text), size)] + [splitter.push("", True)]
        assert "".join(r for r, _ in pieces) == (thinking or "")
        assert "".join(c for _, c in pieces) == content
        assert all("</think>" not in r for r, _ in pieces)  # a tag never leaks out half-split


def test_text_goes_out_as_soon_as_it_cannot_be_a_tag() -> None:
    s = ReasoningSplitter(QWEN3, False)
    assert s.push("<thi") == ("", "")
    assert s.push("nk>\nStep one") == ("Step one", "")
    assert s.push(". </th") == (".", "")
    assert s.push("ink>\n\nPar") == ("", "Par")
    assert s.push("is") == ("", "is")


def test_the_prompt_says_whether_the_answer_starts_inside() -> None:
    assert QWEN3.starts_inside("<|im_start|>assistant\n<think>\n")
    assert not QWEN3.starts_inside("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not QWEN3.starts_inside("<|im_start|>assistant\n")
    assert R1.starts_inside("<｜Assistant｜>")


def test_templates_name_their_parser() -> None:
    assert parser_for_template("{{ '<|im_start|>assistant\\n' }}") is None
    assert parser_for_template("{%- if enable_thinking is false %}{{ '<think>\\n\\n</think>' }}") is QWEN3
    assert parser_for_template("{{'<｜Assistant｜><think>\\n'}}") is R1


HARMONY = REASONING_PARSERS["openai_gptoss"]
CALL = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'


@pytest.mark.parametrize("text, thinking, content", [
    ("<|channel|>analysis<|message|>The user wants <b>weather</b>.<|end|><|start|>assistant<|channel|>final"
     "<|message|>It is sunny.", "The user wants <b>weather</b>.", "It is sunny."),
    ("<|channel|>analysis<|message|>Need the tool.<|end|>" + CALL + "<|call|>", "Need the tool.", CALL),
    ("Plain text from a model that writes no channels.", None, "Plain text from a model that writes no channels."),
])
def test_harmony_channels_split_whole_and_in_every_piece(text: str, thinking: str | None, content: str) -> None:
    from runlm.tools.formats import HarmonyParser
    from runlm.tools.parsers import parse_tool_calls

    assert split_reasoning(HARMONY, False, text) == (thinking, content)
    for size in (1, 2, 3, 7):
        splitter = HARMONY.splitter(False)
        pieces = [splitter.push(text[i:i + size], final=i + size >= len(text)) for i in range(0, len(text), size)]
        assert "".join(p[0] for p in pieces) == (thinking or "") and "".join(p[1] for p in pieces) == content
    if content == CALL:  # the call reaches the tool parser whole
        assert [(c.name, c.arguments) for c in parse_tool_calls(HarmonyParser(), content)[1]] == \
            [("get_weather", '{"city": "Paris"}')]


def test_gpt_oss_templates_name_the_harmony_parser() -> None:
    assert parser_for_template("<|start|>{{ role }}<|channel|>final<|message|>{{ content }}<|end|>") is HARMONY
