"""Tools and tool messages for the chat template.

A template that knows tools (it uses ``tools``) gets them as given, and assistant ``tool_calls``
with their arguments as dicts (templates write them with ``tojson``; OpenAI sends JSON strings).
A template that knows none (SmolLM2's, ChatML) would drop them silently, so runlm writes them
into the system message in the Hermes format (Qwen 2.5's wording), renders earlier calls as
``<tool_call>`` blocks and tool results as ``<tool_response>`` user turns: the format the Hermes
parser reads back.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from runlm.formats.chat_template import CHATML_TEMPLATE, render_chat
from runlm.tools.parsers import arguments_object

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}"
    "\n</tool_call>")


def template_knows_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def _call_text(call: Mapping[str, Any]) -> str:
    fn = call.get("function") or {}
    body = {"name": fn.get("name"), "arguments": arguments_object(fn.get("arguments"))}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def _with_dict_arguments(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    fixed = []
    for call in calls:
        if isinstance(call, Mapping) and isinstance(call.get("function"), Mapping):
            fn = dict(call["function"])
            fn["arguments"] = arguments_object(fn.get("arguments"))
            call = {**call, "function": fn}
        fixed.append(call)
    return {**message, "tool_calls": fixed}


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return "" if content is None else str(content)


def render_tool_chat(messages: Sequence[Mapping[str, Any]], template: str | None, *,
                     tools: list[dict] | None = None, **kwargs: Any) -> str:
    """``render_chat`` for a conversation that may hold tools and tool turns: templates that know no
    tools get them in a Hermes-style system message, and tool-call arguments reach templates as dicts."""
    messages, tools = prepare_tool_messages(messages, tools, template or CHATML_TEMPLATE)
    return render_chat(messages, template, tools=tools, **kwargs)


def prepare_tool_messages(messages: Sequence[Mapping[str, Any]], tools: list[dict] | None,
                          template: str | None) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """(messages, tools) as the template should see them."""
    copies = [_with_dict_arguments(dict(m)) for m in messages]
    has_tool_turns = any(m.get("tool_calls") or m.get("role") == "tool" for m in copies)
    if template_knows_tools(template) or not (tools or has_tool_turns):
        return copies, tools
    out: list[dict[str, Any]] = []
    for m in copies:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            parts = [_text(m.get("content"))] if _text(m.get("content")) else []
            out.append({"role": "assistant", "content": "\n".join(parts + [_call_text(c) for c in m["tool_calls"]])})
        elif m.get("role") == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"})
        else:
            out.append(m)
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        preamble = TOOLS_PREAMBLE.format(tools=listing)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{_text(out[0].get('content'))}\n\n{preamble}"}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out, None
