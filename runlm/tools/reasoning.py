"""Reasoning formats: where a model's output holds its thinking, and how to split it from the answer.

A reasoning model writes ``<think> ... </think>`` before its answer (Qwen3, SmolLM3, DeepSeek-R1 and its
distills). The parsers carry vLLM's names (``--reasoning-parser``):

- qwen3: thinking is what the model writes between ``<think>`` and ``</think>``; a chat template that puts
  ``<think>`` in the generation prompt (Qwen3-Thinking-2507) starts the answer inside it, and one that is told
  ``enable_thinking: false`` closes an empty block in the prompt, so the whole answer is content;
- deepseek_r1: the same tags, but the model may leave out the opening one: everything before ``</think>``
  is thinking (R1 distills put ``<think>`` in the prompt, older templates did not);
- openai_gptoss (gpt-oss's harmony format): messages on channels, ``<|channel|>analysis<|message|>...<|end|>
  <|start|>assistant<|channel|>final<|message|>...``: the analysis channel is the thinking, the final one the
  answer, and a commentary message addressed to a function stays in the answer as written, for
  runlm.tools.formats.HarmonyParser (HarmonySplitter).

Whether the answer starts inside thinking is read from the prompt's text (``starts_inside``), so the same
parser serves a request with thinking turned off. ``ReasoningSplitter`` splits growing text: a tag that
straddles two pieces (tokens or stream chunks) is held back until it is whole, and whitespace around the
thinking (``<think>\\n ... \\n</think>\\n\\n``) is not part of either side. Pure functions over text.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from runlm.tools.parsers import held_back


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    opens_implicitly: bool = False   # everything before `end` is thinking, with or without `start`
    close: str = "\n</think>\n\n"     # what a spent thinking budget forces into the sequence
    harmony: bool = False            # gpt-oss's channels (HarmonySplitter), not tags around the thinking

    def starts_inside(self, prompt_text: str) -> bool:
        """Whether the model's answer begins inside a thinking block, given the prompt it continues."""
        if self.harmony:
            return False  # (its generation prompt ends before a channel is named)
        s, e = prompt_text.rfind(self.start), prompt_text.rfind(self.end)
        if s > e:
            return True
        return self.opens_implicitly and e < 0


    def splitter(self, inside: bool) -> ReasoningSplitter | HarmonySplitter:
        return HarmonySplitter() if self.harmony else ReasoningSplitter(self, inside)


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1", opens_implicitly=True),
    "openai_gptoss": ReasoningParser("openai_gptoss", start="<|channel|>analysis<|message|>", end="<|end|>",
                                     close="<|end|><|start|>assistant<|channel|>final<|message|>", harmony=True),
}


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser ``--reasoning-parser`` names (ValueError naming the known ones otherwise)."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]


def parser_for_template(template: str | None) -> ReasoningParser | None:
    """The format a chat template teaches its model; None for a template that knows no thinking."""
    t = template or ""
    if "<|channel|>" in t and "<|message|>" in t:
        return REASONING_PARSERS["openai_gptoss"]
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


class HarmonySplitter:
    """gpt-oss's harmony messages in, (thinking, content) pieces out, as ReasoningSplitter. A message is a header
    (``<|start|>assistant``, ``<|channel|>NAME``, a recipient ``to=functions.X``, ``<|constrain|>json``) up to
    ``<|message|>``, then its body up to ``<|end|>``, ``<|call|>``, ``<|return|>`` or the next ``<|start|>``.
    Text that opens with no header (a model answering plainly) is the answer."""
    _ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")

    def __init__(self) -> None:
        self.buf, self.state, self.channel = "", "header", "final"
        self.saw_thinking = False

    def push(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while self.buf:
            if self.state == "header":
                lead = self.buf.lstrip()
                if lead and not lead.startswith("<|") and not "<|".startswith(lead):
                    self.state, self.channel = "body", "final"  # no harmony here: all answer
                    continue
                at = self.buf.find("<|message|>")
                if at < 0:
                    if final:
                        content.append(self.buf)
                        self.buf = ""
                    break
                header, self.buf = self.buf[:at], self.buf[at + len("<|message|>"):]
                m = re.search(r"<\|channel\|>\s*(\w+)", header)
                self.channel = m.group(1) if m else "final"
                if "to=functions." in header:  # a call: left whole for the tool parser
                    self.channel = "call"
                    content.append(header + "<|message|>")
                self.state = "body"
            ends = [(at, tag) for tag in self._ENDS if (at := self.buf.find(tag)) >= 0]
            at, tag = min(ends) if ends else (-1, "")
            body = self.buf if at < 0 else self.buf[:at]
            cut = body.rfind("<")
            if at < 0 and not final and cut >= 0 and any(t.startswith(body[cut:]) for t in self._ENDS):
                body = body[:cut]  # may be an end tag arriving
            (reasoning if self.channel == "analysis" else content).append(body)
            self.saw_thinking = self.saw_thinking or self.channel == "analysis"
            if at < 0:
                self.buf = self.buf[len(body):]
                break
            self.buf = self.buf[at + (0 if tag == "<|start|>" else len(tag)):]
            self.state = "header"
        return "".join(reasoning), "".join(content)


def split_reasoning(parser: ReasoningParser, inside: bool, text: str) -> tuple[str | None, str]:
    """A finished answer -> (thinking, or None when it opened no thinking block; content)."""
    splitter = parser.splitter(inside)
    reasoning, content = splitter.push(text, final=True)
    return (reasoning if splitter.saw_thinking else None), content
