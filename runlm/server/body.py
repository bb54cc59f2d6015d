"""Request bodies: JSON parsed and validated by us, so malformed input is always a 400 naming the field."""
from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from runlm.server.errors import bad_request
from runlm.web.json_body import JSONBodyError, parse_json_object

Model = TypeVar("Model", bound=BaseModel)


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
    try:
        data = parse_json_object(await request.body())
    except JSONBodyError as exc:
        raise bad_request(str(exc)) from None
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
