"""Answering an error straight from ASGI middleware, in the shape the route's clients read."""
from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import Scope, Send

from runlm.openai_error import error_body

# (scope, status, message, code) -> the JSON body; each server says which shape its clients read
ErrorWriter = Callable[[Scope, int, str, str], bytes]


def openai_error_json(scope: Scope, status: int, message: str, code: str) -> bytes:
    return json.dumps(error_body(message, "invalid_request_error" if status < 500 else "server_error",
                                 code=code)).encode()


async def send_error(send: Send, body: bytes, status: int, headers: list | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
