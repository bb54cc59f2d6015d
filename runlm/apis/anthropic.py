"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API over the app's chat source
(runlm/apis/source.py); every error, ours or the server's, in Anthropic's shape."""
from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from runlm.apis.anthropic_output import MessageEvents, error_body, whole_message
from runlm.apis.anthropic_request import PARAM_NAMES, chat_request
from runlm.apis.responses import Handler
from runlm.apis.schemas import MessagesCountRequest, MessagesRequest, checked_body
from runlm.apis.source import (
    ChatStream,
    ChunkError,
    ClosingStreamingResponse,
    chat_source,
    error_fields,
    image_paths,
    model_of,
    named_event,
    renamed,
    translate,
)
from runlm.web.openapi import json_body


def _anthropic_errors(handler: Handler) -> Handler:
    @functools.wraps(handler)
    async def wrapped(request: Request, **kw: Any) -> Response:
        try:
            return await handler(request, **kw)
        except Exception as exc:
            fields = error_fields(exc)
            if fields is None:
                raise
            message = fields.message
            if fields.param:  # Anthropic's shape has no param: say it in the message, by the client's own name
                name = PARAM_NAMES.get(fields.param, fields.param)
                message = message if name in message else f"{name}: {message}"
            return JSONResponse(error_body(fields.status, message), status_code=fields.status, headers=fields.headers)
    return wrapped


def _stop_sequences(body: dict[str, Any]) -> list[str]:
    stops = body.get("stop_sequences")
    return [s for s in stops if isinstance(s, str)] if isinstance(stops, list) else []


async def create(request: Request) -> Response:
    body = await checked_body(await request.body(), MessagesRequest)
    stream = body.get("stream") is True
    chat = chat_request(body, stream)
    paths = image_paths(chat)
    source = chat_source(request)
    model = model_of(body)
    try:
        if not stream:
            return JSONResponse(whole_message(await source.complete(chat), model, _stop_sequences(body)))
        chat_stream = await source.open_stream(chat)
    except Exception as exc:
        raise renamed(exc, paths) from None
    return ClosingStreamingResponse(_sse(chat_stream, MessageEvents(model, _stop_sequences(body))), chat_stream)


async def _sse(chat_stream: ChatStream, events: MessageEvents) -> AsyncIterator[str]:
    try:
        async for e in translate(events, chat_stream.chunks, events.model):
            yield named_event(e["type"], e)
    except ChunkError as exc:
        yield named_event("error", error_body(500, exc.error.get("message", "the answer failed")))
    except Exception as exc:
        fields = error_fields(exc)
        if fields is None:
            raise
        yield named_event("error", error_body(fields.status, fields.message))


async def count_tokens(request: Request) -> Response:
    body = await checked_body(await request.body(), MessagesCountRequest)
    chat = chat_request(body, counting=True)
    paths = image_paths(chat)
    try:
        return JSONResponse({"input_tokens": await chat_source(request).count_tokens(chat)})
    except Exception as exc:
        raise renamed(exc, paths) from None


def messages_router(prefixes: tuple[str, ...] = ("/v1",)) -> APIRouter:
    router = APIRouter()
    for prefix in prefixes:
        router.add_api_route(f"{prefix}/messages", _anthropic_errors(create), methods=["POST"],
                             openapi_extra=json_body(MessagesRequest), summary="Create a message (Anthropic)")
        router.add_api_route(f"{prefix}/messages/count_tokens", _anthropic_errors(count_tokens), methods=["POST"],
                             openapi_extra=json_body(MessagesCountRequest), summary="Count input tokens (Anthropic)")
    return router
