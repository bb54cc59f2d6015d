"""A request body as a JSON object, parsed one way on both servers: bad UTF-8, NaN/Infinity, absurd nesting
and non-objects are all a ``JSONBodyError`` (a 400 to the caller), never a 500."""
from __future__ import annotations

import json
from typing import Any


class JSONBodyError(ValueError):
    """The body is not a JSON object."""


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
