"""``tools`` + ``tool_choice`` -> what to constrain, what to show the template, how to parse.

``auto`` leaves the model free and parses its own format. ``required`` and a named function are
enforced with a grammar, as vLLM does: the output is forced to be JSON for the tool's
``parameters`` schema (named), or an array of ``{"name", "parameters"}`` calls (required; one call when
``parallel_tool_calls`` is false), so the call is always valid JSON for its schema. The schema's objects
admit only their declared properties unless it says ``additionalProperties``. ``none`` hides the tools
from the template.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from runlm.tools.parsers import ForcedNamedParser, ForcedRequiredParser, ToolParser, parser_for_template

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A malformed ``tools`` or ``tool_choice``; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class ToolPlan:
    parser: ToolParser | None                  # None: the output is plain content
    structured_outputs: dict[str, Any] | None  # the grammar that enforces tool_choice, if any
    template_tools: list[dict] | None          # what the chat template is given as ``tools``
    forced: bool = False


def check_tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise ToolError("tools", "tools must be a list of {'type': 'function', 'function': {...}}")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise ToolError(f"{where}.type", "only tools of type 'function' are supported")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ToolError(f"{where}.function", "a tool needs a 'function' object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"{where}.function.name",
                            f"function names are 1-64 letters, digits, '_', '.' or '-'; got {name!r}")
        if name in names:
            raise ToolError(f"{where}.function.name", f"the function name {name!r} is used twice")
        names.add(name)
        params = fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(params, Mapping):
            raise ToolError(f"{where}.function.parameters", "parameters must be a JSON schema object")
    return list(tools)


def _parameters(tool: Mapping[str, Any]) -> dict:
    return closed_objects(dict(tool["function"].get("parameters") or EMPTY_PARAMETERS))


_SUBSCHEMAS = ("items", "additionalItems", "not", "if", "then", "else", "contains")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def closed_objects(schema: Any) -> Any:
    """The schema with every object that declares ``properties`` closed to others (``additionalProperties:
    false``) unless it says otherwise, as OpenAI's strict function calling and llama.cpp's tool grammars read a
    tool's parameters; JSON Schema itself would let a grammar add any key, and a small model does."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = closed_objects(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {k: closed_objects(s) for k, s in out[key].items()}
    if isinstance(out.get("properties"), Mapping) and "additionalProperties" not in out \
            and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def _named(tool_choice: Any) -> str | None:
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        if tool_choice.get("type", "function") == "function" and isinstance(fn, Mapping) \
                and isinstance(fn.get("name"), str):
            return fn["name"]
        raise ToolError("tool_choice", "a named tool_choice is {'type': 'function', 'function': {'name': ...}}")
    return None


def plan_tools(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any, template: str | None,
               parallel_tool_calls: bool | None = None) -> ToolPlan:
    tools = check_tools(tools) if tools is not None else []
    named = _named(tool_choice)
    if named is None and tool_choice not in (None, "none", "auto", "required"):
        raise ToolError("tool_choice", f"tool_choice is 'none', 'auto', 'required' or a named function; "
                                       f"got {tool_choice!r}")
    if (named is not None or tool_choice == "required") and not tools:
        raise ToolError("tool_choice", "tool_choice asks for a tool call but no tools were given")
    if not tools or tool_choice == "none":
        return ToolPlan(None, None, None)
    if named is not None:
        tool = next((t for t in tools if t["function"]["name"] == named), None)
        if tool is None:
            raise ToolError("tool_choice.function.name", f"no tool named {named!r} was given")
        return ToolPlan(ForcedNamedParser(named), {"json": _parameters(tool)}, tools, True)
    if tool_choice == "required":
        items = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t)}}
                 for t in tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan(ForcedRequiredParser(), {"json": schema}, tools, True)
    return ToolPlan(parser_for_template(template, tools), None, tools)
