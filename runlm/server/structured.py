"""Structured-output fields of a request -> one StructuredOutputsParams, checked before generation.

Accepted: OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``), vLLM's
``structured_outputs`` object (json, json_object, regex, choice, grammar...) and its older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, and the grammar that a
forcing ``tool_choice`` brings. At most one of them per request. The engine compiles the constraint
when the request is added (on its own thread), before any response header, so a bad schema is a 400
naming the request field, even when streaming; ``structured_error`` names that field.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runlm.engine.types.structured_params import StructuredOutputsError, StructuredOutputsParams
from runlm.server.errors import APIError, bad_request

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _from_response_format(rf: Mapping[str, Any]) -> dict[str, Any] | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, Mapping):
            raise bad_request("response_format.json_schema must be an object with a 'schema'",
                              "response_format.json_schema")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            raise bad_request("response_format.json_schema.schema is required", "response_format.json_schema.schema")
        return {"json": schema}
    raise bad_request(f"response_format type must be 'text', 'json_object' or 'json_schema'; got {kind!r}",
                      "response_format.type")


def _sources(req: Any, forced: dict[str, Any] | None) -> list[tuple[str, dict[str, Any]]]:
    """(request field, structured_outputs dict) for every field that asks for a constraint."""
    found = []
    if req.response_format is not None:
        spec = _from_response_format(req.response_format)
        if spec is not None:
            found.append(("response_format", spec))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", dict(req.structured_outputs)))
    for name, kind in _GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            found.append((name, {kind: value}))
    if forced is not None:
        found.append(("tool_choice", forced))
    return found


def _param_name(source: str, err: StructuredOutputsError) -> str:
    """Where the problem is, in the client's own request."""
    if source == "response_format":
        return "response_format.json_schema.schema" if err.param.endswith(".json") else "response_format"
    if source == "structured_outputs":
        return err.param
    if source == "tool_choice":
        return "tools"
    return source


def structured_outputs_for(req: Any, forced: dict[str, Any] | None = None,
                           ) -> tuple[str, StructuredOutputsParams] | None:
    """The request's constraint and the field it came from (None when it asks for none)."""
    found = _sources(req, forced)
    if not found:
        return None
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise bad_request(f"{names} both constrain the output; use one of them", found[1][0])
    source, spec = found[0]
    try:
        return source, StructuredOutputsParams.from_dict(spec)
    except StructuredOutputsError as err:
        raise bad_request(f"{source}: {err.message}" if source != "structured_outputs" else str(err),
                          _param_name(source, err)) from None


def constraint_source(req: Any, forced: dict[str, Any] | None = None) -> str | None:
    """The request field the constraint came from (to name it in errors), or None."""
    found = _sources(req, forced)
    return found[0][0] if found else None


def structured_error(err: StructuredOutputsError, source: str) -> APIError:
    """A constraint the engine could not compile, as a 400 naming the client's own field."""
    prefix = "" if source == "structured_outputs" else f"{source}: "
    message = f"{prefix}invalid {err.param.rsplit('.', 1)[-1]} constraint: {err.message}"
    return bad_request(message, _param_name(source, err))
