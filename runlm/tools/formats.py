"""The tool-call formats of the 2025-2026 families, beside runlm.tools.parsers' JSON ones (same interface: split
possibly growing text into content and calls; arguments given out as JSON text that only grows):

- qwen3_xml (Qwen3-Coder, Qwen3-Next): ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function>
  </tool_call>``;
- glm45 (GLM-4.5/4.6): ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>``;
- deepseek_v3 (DeepSeek-V3, and V3.1's shorter form): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function
  <｜tool▁sep｜>NAME ```json {...}```<｜tool▁call▁end｜>...`` / ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
  <｜tool▁call▁end｜>``;
- pythonic (Llama 3.2's pythonic template, Llama 4): the answer is ``[name(key=value, ...), ...]``;
- harmony (gpt-oss): a ``commentary`` message addressed ``to=functions.NAME`` holding JSON arguments.

A parameter written as text (the XML forms) is typed by the tool's JSON schema where the request gave one (a string
parameter stays text; numbers, booleans, objects and arrays are read as JSON); without one, text that reads as JSON
other than a bare string is taken as that value (vLLM's parsers do the same)."""
from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from runlm.tools.base import ToolParser, ToolScan, held_back, no_calls
from runlm.tools.json_scan import PartialCall, scan_value, skip_ws

Schemas = Mapping[str, Mapping[str, Any]]  # tool name -> its parameters' JSON schema properties


def tool_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    """Each tool's parameter properties, by name (the request's ``tools``, as checked)."""
    out: dict[str, Mapping[str, Any]] = {}
    for tool in tools or []:
        function = tool.get("function") or {}
        properties = (function.get("parameters") or {}).get("properties") or {}
        if isinstance(properties, Mapping):
            out[str(function.get("name"))] = properties
    return out


def typed_value(text: str, schema: Mapping[str, Any] | None) -> Any:
    """A parameter written as text, as the value its schema's type says (or, without one, JSON where it reads)."""
    kind = schema.get("type") if schema else None
    if kind == "string" or (schema and "enum" in schema and all(isinstance(v, str) for v in schema["enum"])):
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return text if kind is None and isinstance(value, str) else value


class _Arguments:
    """Arguments built one parameter at a time: the JSON text given out so far is always a prefix of the final."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def add(self, key: str, value: Any) -> None:
        self.parts.append(f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")

    def text(self, done: bool) -> str:
        return "{" + ", ".join(self.parts) + ("}" if done else "")


class _TaggedParser(ToolParser):
    """Calls between START and END tags, each read by ``call`` (text inside the tags, whether END was seen)."""
    START = END = ""

    def __init__(self, schemas: Schemas | None = None) -> None:
        self.schemas = schemas or {}

    def scan(self, text: str, final: bool) -> ToolScan:
        first = text.find(self.START)
        if first < 0:
            return no_calls(text, self.START, final)
        calls, pos = [], first
        while pos >= 0:
            body = pos + len(self.START)
            close = text.find(self.END, body)
            call = self.call(text[body:] if close < 0 else text[body:close], close >= 0)
            call.end = len(text) if close < 0 else close + len(self.END)
            calls.append(call)
            pos = text.find(self.START, call.end) if close >= 0 else -1
        return ToolScan(text[:first], calls)

    def call(self, body: str, closed: bool) -> PartialCall:
        raise NotImplementedError

    def value(self, name: str | None, key: str, text: str) -> Any:
        return typed_value(text, (self.schemas.get(name or "") or {}).get(key))


def _param_text(text: str) -> str:
    """A parameter's text between its tags: one newline either side is the format's, not the value's."""
    text = text[1:] if text.startswith("\n") else text
    return text[:-1] if text.endswith("\n") else text


class Qwen3XmlParser(_TaggedParser):
    name = "qwen3_xml"
    START, END = "<tool_call>", "</tool_call>"
    _PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)

    def call(self, body: str, closed: bool) -> PartialCall:
        m = re.search(r"<function=([^>\n]+)>", body)
        if m is None:
            return PartialCall()
        name, args = m.group(1).strip(), _Arguments()
        rest = body[m.end():]
        for p in self._PARAM.finditer(rest):
            args.add(p.group(1).strip(), self.value(name, p.group(1).strip(), _param_text(p.group(2))))
        done = "</function>" in rest
        return PartialCall(name, args.text(done), done, done and closed)


class Glm45Parser(_TaggedParser):
    name = "glm45"
    START, END = "<tool_call>", "</tool_call>"
    _ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def call(self, body: str, closed: bool) -> PartialCall:
        m = re.match(r"\s*([^\s<]*)(?=[\s<])", body)  # the name, ended by a newline or the first tag
        if m is None and not closed:
            return PartialCall()  # the name may still grow
        name, args = (m.group(1) if m else body).strip(), _Arguments()
        for a in self._ARG.finditer(body):
            args.add(a.group(1).strip(), self.value(name, a.group(1).strip(), a.group(2)))
        return PartialCall(name or None, args.text(closed), closed, closed)


class DeepSeekV3Parser(_TaggedParser):
    name = "deepseek_v3"
    needs_special_tokens = True
    START, END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    BEGIN = "<｜tool▁calls▁begin｜>"

    def scan(self, text: str, final: bool) -> ToolScan:
        first = text.find(self.BEGIN)
        if first < 0:
            return no_calls(text, self.BEGIN, final)
        return ToolScan(text[:first], super().scan(text[first:], final).calls)

    def call(self, body: str, closed: bool) -> PartialCall:
        sep = body.find(self.SEP)
        if sep < 0:
            return PartialCall()
        kind, rest = body[:sep].strip(), body[sep + len(self.SEP):]
        if kind == "function":  # V3: the name on its own line, the arguments fenced as JSON
            line = rest.find("\n")
            if line < 0:
                return PartialCall()
            name, rest = rest[:line].strip(), rest[line + 1:]
            fence = rest.find("```json")
            if fence < 0 and not closed:
                return PartialCall(name)  # its arguments' fence still to come
            rest = rest[fence + len("```json"):] if fence >= 0 else rest
        else:  # V3.1: the name before the separator, the arguments right after it
            name = kind
        j = skip_ws(rest, 0)
        end, complete = scan_value(rest, j)
        return PartialCall(name, rest[j:end], complete, complete and closed)


class PythonicParser(ToolParser):
    name = "pythonic"
    TAGS = ("<|python_start|>", "<|python_end|>")

    def scan(self, text: str, final: bool) -> ToolScan:
        body = text.replace(self.TAGS[0], "").replace(self.TAGS[1], "")
        j = skip_ws(body, 0)
        if j >= len(body) or body[j] != "[":
            if not final and (j >= len(body) or self.TAGS[0].startswith(body[j:])):
                return ToolScan("", [])
            return ToolScan(text, [])
        calls = _pythonic_calls(body[j:].rstrip())
        if calls is None:  # not (yet) a whole list of calls: held back until it is, content if it never is
            return ToolScan(text if final else "", [])
        return ToolScan("", [PartialCall(name, json.dumps(args, ensure_ascii=False), True, True, len(text))
                             for name, args in calls])


def _pythonic_calls(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
            return None
        name = ast.unparse(node.func)
        try:
            calls.append((name, {str(k.arg): ast.literal_eval(k.value) for k in node.keywords}))
        except ValueError:
            return None
    return calls


class HarmonyParser(ToolParser):
    """gpt-oss's harmony messages: a call is a ``commentary`` message whose header says ``to=functions.NAME``, its
    body the JSON arguments (what runlm.tools.reasoning's harmony splitter leaves in the content for it)."""
    name = "harmony"
    needs_special_tokens = True
    _HEADER = re.compile(r"to=functions\.([^\s<]+)[^<]*(?:<\|constrain\|>[^<]*)?(?:<\|channel\|>[^<]*)?<\|message\|>")

    def scan(self, text: str, final: bool) -> ToolScan:
        first = text.find("to=functions.")
        if first < 0:
            if final:
                return ToolScan(text, [])
            # a message header still arriving may address a function: held back until its <|message|>
            header = max(text.rfind("<|start|>"), text.rfind("<|channel|>"))
            if header >= 0 and "<|message|>" not in text[header:]:
                return ToolScan(text[:header], [])
            return ToolScan(held_back(held_back(text, "<|start|>"), "<|channel|>"), [])
        start = text.rfind("<|start|>", 0, first)
        start = start if start >= 0 else text.rfind("<|channel|>", 0, first)
        calls = []
        for m in self._HEADER.finditer(text, first):
            j = skip_ws(text, m.end())
            end, complete = scan_value(text, j)
            calls.append(PartialCall(m.group(1), text[j:end], complete, complete, end))
        return ToolScan(text[:max(start, 0)], calls)


FORMAT_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (Qwen3XmlParser, Glm45Parser, DeepSeekV3Parser, PythonicParser, HarmonyParser)}


def format_for_template(template: str) -> str | None:
    """Which of these formats a chat template teaches (None: none of them)."""
    if "<|channel|>" in template and "to=functions." in template:
        return "harmony"
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_xml"
    if "<arg_key>" in template:
        return "glm45"
    if "<｜tool▁calls▁begin｜>" in template:
        return "deepseek_v3"
    if "func_name1(" in template or "[func_name(" in template:
        return "pythonic"
    return None
