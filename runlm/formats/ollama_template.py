"""A chat rendered through an Ollama TEMPLATE (Go's text/template, runlm/formats/go_template.py) as Ollama renders it.

The template sees Ollama's values: ``.System`` (every system message, joined by blank lines), ``.Messages``
(consecutive messages of one role merged, each with ``.Role``, ``.Content``, ``.Thinking``, ``.Images``,
``.ToolCalls`` (``.Function.Name``/``.Function.Arguments``), ``.ToolName``, ``.ToolCallID``), ``.Tools`` (each
``.Type`` and ``.Function.Name``/``.Description``/``.Parameters``, printing as its JSON), ``.Response`` (empty),
``.Think``, ``.ThinkLevel``, ``.IsThinkSet``. A template that never reads ``.Messages`` is an older one written
for ``.System``/``.Prompt``/``.Response``: it is rendered once per exchange, and for the last one only up to
``.Response``, so the prompt ends where the answer begins (Ollama's template.Execute).
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from functools import lru_cache
from typing import Any

from runlm.formats.go_template import GoStruct, GoTemplate, parse


@lru_cache(maxsize=32)
def compiled(source: str) -> GoTemplate:
    return parse(source)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    return "" if content is None else str(content)


def _images(content: Any) -> list[Any]:
    if not isinstance(content, list):
        return []
    return [p for p in content if isinstance(p, Mapping) and p.get("type") in ("image", "image_url")]


def _sorted(value: Any) -> Any:
    """A JSON value with every object's keys sorted (Go's maps encode that way)."""
    if isinstance(value, Mapping):
        return {k: _sorted(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            return {}
    return _sorted(raw) if isinstance(raw, Mapping) else {}


def _object(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _tool_call(call: Mapping[str, Any], index: int) -> GoStruct:
    fn = _object(call.get("function"))
    args = _arguments(fn.get("arguments"))
    function = GoStruct({"Index": index, "Name": str(fn.get("name", "")), "Arguments": args},
                        {**({"index": index} if index else {}), "name": str(fn.get("name", "")), "arguments": args})
    return GoStruct({"ID": str(call.get("id", "")), "Function": function},
                    {**({"id": call["id"]} if call.get("id") else {}), "function": function})


def _message(m: Mapping[str, Any]) -> GoStruct:
    content, images = _text(m.get("content")), _images(m.get("content"))
    thinking = str(m.get("reasoning_content") or m.get("thinking") or "")
    calls = [_tool_call(c, i) for i, c in enumerate(m.get("tool_calls") or []) if isinstance(c, Mapping)]
    tool_name = str(m.get("name") or m.get("tool_name") or "")
    fields = {"Role": str(m.get("role", "")), "Content": content, "Thinking": thinking, "Images": images,
              "ToolCalls": calls, "ToolName": tool_name, "ToolCallID": str(m.get("tool_call_id") or "")}
    form: dict[str, Any] = {"role": fields["Role"], "content": content}
    for key, name in (("thinking", "Thinking"), ("tool_calls", "ToolCalls"), ("tool_name", "ToolName"),
                      ("tool_call_id", "ToolCallID")):
        if fields[name]:
            form[key] = fields[name]
    return GoStruct(fields, form)


def _property(schema: Any) -> GoStruct:
    schema = _object(schema)
    kind = schema.get("type")
    kind = kind[0] if isinstance(kind, list) and len(kind) == 1 else kind
    items = schema.get("items")
    fields = {"Type": kind, "Items": _sorted(items) if items is not None else None,
              "Description": str(schema.get("description", "")), "Enum": list(schema.get("enum") or [])}
    form = {k: v for k, v in (("type", kind), ("items", fields["Items"]), ("description", fields["Description"]),
                              ("enum", fields["Enum"])) if v not in (None, "", [])}
    return GoStruct(fields, form)


def _tool(tool: Mapping[str, Any]) -> GoStruct:
    fn = _object(tool.get("function"))
    params = _object(fn.get("parameters"))
    props = _object(params.get("properties"))
    properties = {name: _property(props[name]) for name in sorted(props)}
    required = [str(r) for r in params.get("required") or []]
    parameters = GoStruct({"Type": str(params.get("type", "")), "Required": required, "Properties": properties},
                          {"type": str(params.get("type", "")),
                           **({"required": required} if required else {}), "properties": properties})
    function = GoStruct({"Name": str(fn.get("name", "")), "Description": str(fn.get("description", "")),
                         "Parameters": parameters},
                        {"name": str(fn.get("name", "")),
                         **({"description": fn["description"]} if fn.get("description") else {}),
                         "parameters": parameters})
    kind = str(tool.get("type", "function"))
    return GoStruct({"Type": kind, "Function": function}, {"type": kind, "function": function})


def collate(messages: Sequence[Mapping[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """Ollama's collate: every system message's text joined by blank lines, and the messages with each run of one
    role merged into one message."""
    system: list[str] = []
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("role") == "system":
            system.append(_text(m.get("content")))
        if out and out[-1].get("role") == m.get("role") and m.get("role") != "tool":
            out[-1] = {**out[-1], "content": _text(out[-1].get("content")) + "\n\n" + _text(m.get("content"))}
        else:
            out.append(dict(m))
    return "\n\n".join(system), out


def render_ollama(source: str, messages: Sequence[Mapping[str, Any]], tools: list[dict] | None = None,
                  extra: Mapping[str, Any] | None = None) -> Iterator[str]:
    """The prompt text for ``messages`` through the Go template ``source``, generated piece by piece (the caller
    bounds its size and time). ``extra``: chat_template_kwargs (``enable_thinking``, ``reasoning_effort``)."""
    template = compiled(source)
    extra = extra or {}
    system, merged = collate(messages)
    think = {"Think": bool(extra.get("enable_thinking", False)), "ThinkLevel": str(extra.get("reasoning_effort") or ""),
             "IsThinkSet": "enable_thinking" in extra}
    if "Messages" in template.fields():
        yield from template.generate({"System": system, "Messages": [_message(m) for m in merged],
                                      "Tools": [_tool(t) for t in tools or [] if isinstance(t, Mapping)],
                                      "Response": "", **think})
        return
    turn = {"System": "", "Prompt": "", "Response": ""}

    def flush() -> Iterator[str]:
        yield from template.generate({**turn, **think})
        turn.update(System="", Prompt="", Response="")

    for m in merged:
        role, text = m.get("role"), _text(m.get("content"))
        if role == "system":
            if turn["Prompt"] or turn["Response"]:
                yield from flush()
            turn["System"] = text
        elif role in ("user", "tool"):
            if turn["Response"]:
                yield from flush()
            turn["Prompt"] = text
        elif role == "assistant":
            turn["Response"] = text
    yield from template.cut_after_response().generate({**turn, **think})
