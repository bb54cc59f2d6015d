"""The API key check of both servers, as pure ASGI middleware (no buffering, so streams and disconnects pass
straight through): ``Authorization: Bearer KEY`` or ``x-api-key: KEY``, compared in constant time."""
from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from runlm.web.asgi import ErrorWriter, openai_error_json, send_error

# serve-engine's routes open without a key: probes and scrapers must not need the secret
OPEN_PATHS = frozenset({"/health", "/liveness", "/readiness", "/metrics", "/version", "/openapi.json", "/docs"})


class APIKeyMiddleware:
    """Every route but ``open_paths`` needs the key."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = OPEN_PATHS,
                 write_error: ErrorWriter = openai_error_json) -> None:
        self.app, self.key, self.open_paths, self.write_error = app, api_key.encode(), open_paths, write_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in self.open_paths:
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
        await send_error(send, self.write_error(scope, 401, message, "invalid_api_key"), 401,
                         [(b"www-authenticate", b"Bearer")])
