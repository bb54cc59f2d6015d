"""Reasoning formats: where a model's output holds its thinking, and how to split it from the answer.

A reasoning model writes ``<think> ... </think>`` before its answer (Qwen3, SmolLM3, DeepSeek-R1 and its
distills). The parsers carry vLLM's names (``--reasoning-parser``):

- qwen3: thinking is what the model writes between ``<think>`` and ``</think>``; a chat template that puts
  ``<think>`` in the generation prompt (Qwen3-Thinking-2507) starts the answer inside it, and one that is told
  ``enable_thinking: false`` closes an empty block in the prompt, so the whole answer is content;
- deepseek_r1: the same tags, but the model may leave out the opening one: everything before ``</think>``
  is thinking (R1 distills put ``<think>`` in the prompt, older templates did not).

Whether the answer starts inside thinking is read from the prompt's text (``starts_inside``), so the same
parser serves a request with thinking turned off. ``ReasoningSplitter`` splits growing text: a tag that
straddles two pieces (tokens or stream chunks) is held back until it is whole, and whitespace around the
thinking (``<think>\\n ... \\n</think>\\n\\n``) is not part of either side. Pure functions over text.
"""
from __future__ import annotations

from dataclasses import dataclass

from runlm.tools.parsers import held_back


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    opens_implicitly: bool = False   # everything before `end` is thinking, with or without `start`
    close: str = "\n</think>\n\n"     # what a spent thinking budget forces into the sequence

    def starts_inside(self, prompt_text: str) -> bool:
        """Whether the model's answer begins inside a thinking block, given the prompt it continues."""
        s, e = prompt_text.rfind(self.start), prompt_text.rfind(self.end)
        if s > e:
            return True
        return self.opens_implicitly and e < 0


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1", opens_implicitly=True),
}


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser ``--reasoning-parser`` names (ValueError naming the known ones otherwise)."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]


def parser_for_template(template: str | None) -> ReasoningParser | None:
    """The format a chat template teaches its model; None for a template that knows no thinking."""
    t = template or ""
    if "<think>" not in t and "</think>" not in t:
        return None
    if "<｜Assistant｜>" in t:  # DeepSeek-R1 and its distills (full-width bars)
        return REASONING_PARSERS["deepseek_r1"]
    return REASONING_PARSERS["qwen3"]


class ReasoningSplitter:
    """One answer's text in, (thinking, content) pieces out. ``push(text, final=True)`` once on the whole
    text gives what pushing it piece by piece gives, joined."""

    def __init__(self, parser: ReasoningParser, inside: bool) -> None:
        self.parser = parser
        self.state = "inside" if inside else "before"
        self.buf = ""                    # text not yet given out
        self.reasoning_started = False   # leading whitespace of the thinking is dropped
        self.content_started = False     # ... and of the answer after it
        self.saw_thinking = inside

    def push(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buf += text
        reasoning, content = "", ""
        if self.state == "before":
            lead = self.buf.lstrip()
            if lead.startswith(self.parser.start):
                self.buf = lead[len(self.parser.start):]
                self.state, self.saw_thinking = "inside", True
            elif not final and (not lead or self.parser.start.startswith(lead)):
                return "", ""  # could still become the opening tag
            else:
                self.state = "after"
        if self.state == "inside":
            if not self.reasoning_started:
                self.buf = self.buf.lstrip()
            at = self.buf.find(self.parser.end)
            if at >= 0:
                reasoning = self.buf[:at].rstrip()
                self.buf, self.state = self.buf[at + len(self.parser.end):], "after"
            else:
                # hold back what may be the start of the end tag, and whitespace that may precede it
                reasoning = (self.buf if final else held_back(self.buf, self.parser.end)).rstrip()
                self.buf = "" if final else self.buf[len(reasoning):]
            self.reasoning_started = self.reasoning_started or bool(reasoning)
        if self.state == "after":
            content = self.buf if self.content_started else self.buf.lstrip()
            self.content_started = self.content_started or bool(content)
            self.buf = ""
        return reasoning, content


def split_reasoning(parser: ReasoningParser, inside: bool, text: str) -> tuple[str | None, str]:
    """A finished answer -> (thinking, or None when it opened no thinking block; content)."""
    splitter = ReasoningSplitter(parser, inside)
    reasoning, content = splitter.push(text, final=True)
    return (reasoning if splitter.saw_thinking else None), content
