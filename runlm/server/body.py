"""Request bodies: JSON parsed and validated by the parser both servers share (runlm/web/json_body.py), so
malformed input is always a 400 naming the field."""
from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from runlm.server.errors import bad_request
from runlm.web.json_body import JSONBodyError, parse_json_object, validate_body

Model = TypeVar("Model", bound=BaseModel)


async def parse_body(request: Request, model: type[Model]) -> Model:
    try:
        return validate_body(model, parse_json_object(await request.body()))
    except JSONBodyError as exc:
        raise bad_request(str(exc), exc.param) from None
