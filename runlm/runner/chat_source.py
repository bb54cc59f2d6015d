"""The daemon's chat source for the translated APIs (runlm/apis): chat completions forwarded to the model's
backend, so /v1/responses and /v1/messages work whatever backend serves the model. A backend's error
answer keeps its status and message."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from runlm.apis.source import ChatStream, ProtocolError
from runlm.runner.proxy import BackendAnswer, post_to_backend, sse_events
from runlm.web.disconnect import unless_disconnected


def _backend_error(status: int, raw: bytes) -> ProtocolError:
    try:
        err = json.loads(raw)["error"]
        if isinstance(err, str):  # llama.cpp's and some others' plain shape
            err = {"message": err}
        return ProtocolError(status, str(err.get("message")), err.get("param"), err.get("code"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return ProtocolError(status, f"the backend answered {status}: {raw[:200]!r}")


@dataclass(slots=True)
class BackendChatSource:
    request: Request

    async def _post(self, route: str, body: dict[str, Any]) -> BackendAnswer:
        loader = self.request.app.state.loader
        backend = self.request.path_params.get("backend")
        if backend is not None and backend not in loader.backends:
            raise ProtocolError(404, f"unknown backend {backend!r} (backends: {', '.join(loader.backends)})")
        # until the headers come back, a client that leaves cancels the request (and its model load)
        return await unless_disconnected(self.request, post_to_backend(loader, route, body, {}, backend))

    async def _json(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = await self._post(route, body)
        raw = await answer.read()
        if answer.resp.status_code >= 400:
            raise _backend_error(answer.resp.status_code, raw)
        return json.loads(raw)

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._json("chat/completions", body)

    async def open_stream(self, body: dict[str, Any]) -> ChatStream:
        answer = await self._post("chat/completions", body)
        if answer.resp.status_code >= 400 or \
                not answer.resp.headers.get("content-type", "").startswith("text/event-stream"):
            raise _backend_error(answer.resp.status_code, await answer.read())

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            try:
                async for chunk in sse_events(answer.runner, answer.resp):
                    yield chunk
            finally:
                await answer.close()
        return ChatStream(chunks(), answer.close)

    async def count_tokens(self, body: dict[str, Any]) -> int:
        answer = await self._json("count_tokens", {k: body[k] for k in ("model", "messages", "tools") if k in body})
        count = answer.get("input_tokens", answer.get("count"))
        if not isinstance(count, int):
            raise ProtocolError(502, "the backend's /v1/count_tokens answered without a count")
        return count
