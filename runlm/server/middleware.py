"""Pure ASGI middleware (no buffering, so streams and disconnects pass straight through):
an API key check and a request-body size limit, both answering in OpenAI's error shape."""
from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runlm.server.errors import error_body

# open without a key: probes and scrapers must not need the secret
OPEN_PATHS = frozenset({"/health", "/liveness", "/readiness", "/metrics", "/version"})


async def _send_error(send: Send, status: int, message: str, code: str, headers: list | None = None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """Every route but OPEN_PATHS needs ``Authorization: Bearer KEY`` (or ``x-api-key: KEY``)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"x-api-key", b"")
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        if given and hmac.compare_digest(given, self.key):
            return await self.app(scope, receive, send)
        message = "Incorrect API key provided." if given else \
            "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'."
        await _send_error(send, 401, message, "invalid_api_key", [(b"www-authenticate", b"Bearer")])


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """413 for a body over ``limit`` bytes: at once from Content-Length, else while it streams in."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"the request body is larger than the server's limit of {self.limit} bytes"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await _send_error(send, 413, message, "request_too_large")
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await _send_error(send, 413, message, "request_too_large")
