"""Tool-call formats: where a model's output holds calls, and how to read them.

Each parser splits (possibly still growing) text into content and calls. ``final=False`` is for
streaming: content that might still turn out to be the start of a call is held back.

- hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen 2/2.5/3, SmolLM3,
  and the prompt runlm writes for templates that know no tools);
- llama3_json: the whole answer is ``{"name": ..., "parameters": {...}}`` (``;`` between calls),
  optionally after ``<|python_tag|>``;
- mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` or ``[TOOL_CALLS]name[ARGS]{...}``;
- forced_named / forced_required: the JSON that ``tool_choice`` forces with a grammar (choice.py);
- the formats of the 2025-2026 families (Qwen3-Coder's XML, GLM-4.5's, DeepSeek-V3's, pythonic, gpt-oss's harmony):
  runlm.tools.formats.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from runlm.tools.base import ToolCall, ToolParser, ToolScan, held_back, new_call_id, no_calls
from runlm.tools.json_scan import PartialCall, scan_call, scan_calls, scan_value, skip_ws

__all__ = ["ToolCall", "ToolParser", "ToolScan", "held_back", "new_call_id", "parse_tool_calls", "parser_for_template"]


class HermesParser(ToolParser):
    name = "hermes"
    START = "<tool_call>"

    def scan(self, text: str, final: bool) -> ToolScan:
        first = text.find(self.START)
        if first < 0:
            return no_calls(text, self.START, final)
        calls, pos = [], first
        while pos >= 0:
            body = skip_ws(text, pos + len(self.START))
            if body < len(text):
                calls.append(scan_call(text, body) if text[body] == "{" else PartialCall(end=body))
            pos = text.find(self.START, body)
        return ToolScan(text[:first], calls)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> ToolScan:
        j = skip_ws(text, 0)
        if text.startswith(self.TAG, j):
            j = skip_ws(text, j + len(self.TAG))
        elif not final and j < len(text) and self.TAG.startswith(text[j:]):
            return ToolScan("", [])  # could still become the tag
        if j >= len(text):
            return ToolScan(text if final else "", [])
        if text[j] != "{":
            return ToolScan(text, [])
        return ToolScan("", scan_calls(text, j, ";")[0])


class MistralParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def scan(self, text: str, final: bool) -> ToolScan:
        first = text.find(self.TAG)
        if first < 0:
            return no_calls(text, self.TAG, final)
        j = skip_ws(text, first + len(self.TAG))
        if j < len(text) and text[j] == "[":  # v3: a JSON array of calls
            return ToolScan(text[:first], scan_calls(text, j + 1, ",")[0])
        calls, pos = [], first
        while pos >= 0:  # v11+: [TOOL_CALLS]name[ARGS]{...}, repeated
            start = pos + len(self.TAG)
            args_at = text.find(self.ARGS, start)
            if args_at < 0:
                break
            value_at = skip_ws(text, args_at + len(self.ARGS))
            end, complete = scan_value(text, value_at)
            calls.append(PartialCall(text[start:args_at].strip(), text[value_at:end], complete, complete, end))
            pos = text.find(self.TAG, end)
        return ToolScan(text[:first], calls)


class ForcedNamedParser(ToolParser):
    """tool_choice names a function: the whole output is that function's arguments object."""
    name = "forced_named"

    def __init__(self, function: str) -> None:
        self.function = function

    def scan(self, text: str, final: bool) -> ToolScan:
        j = skip_ws(text, 0)
        end, complete = scan_value(text, j)
        return ToolScan("", [PartialCall(self.function, text[j:end], complete, complete, end)])


class ForcedRequiredParser(ToolParser):
    """tool_choice "required": the output is a JSON array of {"name", "parameters"} objects."""
    name = "forced_required"

    def scan(self, text: str, final: bool) -> ToolScan:
        j = skip_ws(text, 0)
        if j >= len(text) or text[j] != "[":
            return ToolScan("", [])
        return ToolScan("", scan_calls(text, j + 1, ",")[0])


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def parser_for_template(template: str | None, tools: Sequence[Mapping[str, Any]] | None = None) -> ToolParser:
    """The format a chat template teaches its model; Hermes when it teaches none (runlm's own prompt). ``tools``: the
    request's, whose schemas type the parameters of the formats that write them as text (runlm.tools.formats)."""
    from runlm.tools import formats

    t = template or ""
    name = formats.format_for_template(t)
    if name is not None:
        cls = formats.FORMAT_PARSERS[name]
        return cls(formats.tool_schemas(tools)) if issubclass(cls, formats._TaggedParser) else cls()
    if "[TOOL_CALLS]" in t:
        return MistralParser()
    if "<tool_call>" in t:
        return HermesParser()
    if "<|python_tag|>" in t or '"parameters": ' in t:
        return Llama3JsonParser()
    return HermesParser()


def parse_tool_calls(parser: ToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """A finished output -> (content, calls). Output that does not hold well-formed calls is all content."""
    scan = parser.scan(text, final=True)
    if not scan.calls or not all(c.valid for c in scan.calls):
        return text, []
    content = scan.content if scan.content.strip() else None
    return content, [ToolCall(new_call_id(), c.name or "", c.final_arguments) for c in scan.calls]


def cut_short_calls(parser: ToolParser, text: str) -> list[ToolCall]:
    """The named calls of an output that stopped before they closed (max_tokens inside a forced call), their
    arguments as far as they were written: what a stream of the same output has sent."""
    return [ToolCall(new_call_id(), c.name, c.final_arguments if c.arguments_done else c.arguments)
            for c in parser.scan(text, final=True).calls if c.name]


def arguments_object(arguments: str | dict | None) -> dict:
    """A call's arguments as a dict (templates want one; OpenAI messages carry a JSON string)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
