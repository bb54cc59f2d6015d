"""A request body as a JSON object, parsed one way on both servers: bad UTF-8, NaN/Infinity, absurd nesting
and non-objects are all a ``JSONBodyError`` (a 400 to the caller), never a 500."""
from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)


class JSONBodyError(ValueError):
    """The body is not a JSON object, or not the request model; ``param`` names the field when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw: bytes, empty: dict[str, Any] | None = None) -> dict[str, Any]:
    """``raw`` as a dict; an empty body is ``empty`` when given (routes whose fields are all optional)."""
    if not raw.strip() and empty is not None:
        return dict(empty)
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        raise JSONBodyError(f"the request body is not UTF-8: {exc.reason} at byte {exc.start}") from None
    except RecursionError:
        raise JSONBodyError("the request body is nested too deeply") from None
    except ValueError as exc:
        raise JSONBodyError(f"the request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise JSONBodyError("the request body must be a JSON object")
    return data


def _loc(loc: tuple) -> str:
    """('stop', 'list[str]', 2) -> 'stop[2]': pydantic also names the union member it tried; drop that."""
    out = str(loc[0]) if loc else ""
    for part in loc[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool", "dict", "list"):
            out += f".{part}"
    return out


def validate_body(model: type[Model], data: dict[str, Any]) -> Model:
    """``data`` as ``model``, or a JSONBodyError naming the offending field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # of a union's failed branches, the one that got deepest says best what is wrong
        err = max(exc.errors(include_url=False), key=lambda e: len(_loc(e["loc"])))
        field = _loc(err["loc"]) or None
        if err["type"] == "missing":
            raise JSONBodyError(f"{field} is required", field) from None
        raise JSONBodyError(f"invalid value for {field}: {err['msg']}", field) from None
    except RecursionError:
        raise JSONBodyError("the request body is nested too deeply") from None
