"""Request bodies: JSON parsed and validated by us, so malformed input is always a 400 naming the field."""
from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from runlm.server.errors import bad_request

Model = TypeVar("Model", bound=BaseModel)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _loc(loc: tuple) -> str:
    """('stop', 'list[str]', 2) -> 'stop[2]': pydantic also names the union member it tried; drop that."""
    out = str(loc[0]) if loc else ""
    for part in loc[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool", "dict", "list"):
            out += f".{part}"
    return out


async def parse_body(request: Request, model: type[Model]) -> Model:
    raw = await request.body()
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise bad_request(f"the request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # of a union's failed branches, the one that got deepest says best what is wrong
        err = max(exc.errors(include_url=False), key=lambda e: len(_loc(e["loc"])))
        field = _loc(err["loc"]) or None
        msg = err["msg"]
        if err["type"] == "missing":
            raise bad_request(f"{field} is required", field) from None
        raise bad_request(f"invalid value for {field}: {msg}", field) from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
