"""413 for a request body over the limit: at once from Content-Length, else while it streams in (pure ASGI:
nothing is buffered, so streams and disconnects pass straight through)."""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runlm.web.asgi import ErrorWriter, openai_error_json, send_error

DEFAULT_MAX_BODY = 32 << 20  # room for a 20 MiB image sent as base64


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, limit: int, write_error: ErrorWriter = openai_error_json) -> None:
        self.app, self.limit, self.write_error = app, limit, write_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"the request body is larger than the server's limit of {self.limit} bytes"
        error = self.write_error(scope, 413, message, "request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await send_error(send, error, 413)
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
                await send_error(send, error, 413)
