"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``:
OpenAI's Responses API over the app's chat source (runlm/apis/source.py), mounted by serve-engine and by the
daemon under its OpenAI prefixes."""
from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from runlm.apis.responses_items import input_items, items_page
from runlm.apis.responses_output import (
    ResponseEvents,
    ResponseShell,
    new_id,
    whole_response,
)
from runlm.apis.responses_request import PARAM_NAMES, chat_request, input_messages
from runlm.apis.responses_store import ResponseStore, StoredResponse
from runlm.apis.schemas import ResponsesRequest, checked_body
from runlm.apis.source import (
    ChatStream,
    ChunkError,
    ClosingStreamingResponse,
    ProtocolError,
    chat_source,
    error_fields,
    image_paths,
    model_of,
    named_event,
    renamed,
    translate,
)
from runlm.openai_error import error_body
from runlm.web.openapi import json_body

Handler = Callable[..., Coroutine[Any, Any, Response]]


def _error_response(exc: BaseException) -> JSONResponse:
    fields = error_fields(exc)
    if fields is None:
        raise exc
    param = PARAM_NAMES.get(fields.param or "", fields.param)
    kind = "invalid_request_error" if fields.status < 500 else "server_error"
    return JSONResponse(error_body(fields.message, kind, param, fields.code), status_code=fields.status,
                        headers=fields.headers)


def _openai_errors(handler: Handler) -> Handler:
    @functools.wraps(handler)  # FastAPI reads the handler's own parameters through __wrapped__
    async def wrapped(request: Request, **kw: Any) -> Response:
        try:
            return await handler(request, **kw)
        except Exception as exc:  # ours, the server's and the daemon's errors, in OpenAI's shape
            return _error_response(exc)
    return wrapped


def _store(request: Request) -> ResponseStore:
    return request.app.state.response_store


def _stored(history: list[dict[str, Any]], body: dict[str, Any], response: dict[str, Any]) -> StoredResponse:
    conversation = history + input_messages(body["input"]) + input_messages(response["output"])
    image_paths({"messages": conversation})  # (the paths were this request's)
    return StoredResponse(response, conversation, input_items(body["input"]))


async def create(request: Request) -> Response:
    body = await checked_body(await request.body(), ResponsesRequest)
    prev = body.get("previous_response_id")
    history = _store(request).get(prev, "previous_response_id").conversation if prev else []
    stream = body.get("stream") is True
    chat = chat_request(body, history, stream)
    paths = image_paths(chat)
    source = chat_source(request)
    keep = body.get("store", True) is not False
    shell = ResponseShell(new_id("resp"), model_of(body), body)
    if not stream:
        try:
            answer = await source.complete(chat)
        except Exception as exc:
            raise renamed(exc, paths) from None
        shell.model = answer.get("model") or shell.model
        response = whole_response(shell, answer)
        if keep:
            _store(request).put(_stored(history, body, response))
        return JSONResponse(response)
    try:
        chat_stream = await source.open_stream(chat)
    except Exception as exc:
        raise renamed(exc, paths) from None
    return ClosingStreamingResponse(_sse(request, chat_stream, shell, history, body, keep), chat_stream)


async def _sse(request: Request, chat_stream: ChatStream, shell: ResponseShell, history: list[dict[str, Any]],
               body: dict[str, Any], keep: bool) -> AsyncIterator[str]:
    events = ResponseEvents(shell)
    try:
        async for e in translate(events, chat_stream.chunks, shell.model):
            if e["type"] in ("response.completed", "response.incomplete") and keep:
                _store(request).put(_stored(history, body, e["response"]))
            yield named_event(e["type"], e)
    except ChunkError as exc:
        for e in events.failed(exc.error.get("message", "the answer failed"), exc.error.get("code")):
            yield named_event(e["type"], e)
    except Exception as exc:
        fields = error_fields(exc)
        if fields is None:
            raise
        for e in events.failed(fields.message, fields.code):
            yield named_event(e["type"], e)


async def retrieve(request: Request, response_id: str) -> Response:
    return JSONResponse(_store(request).get(response_id).response)


async def list_input_items(request: Request, response_id: str) -> Response:
    q = request.query_params
    return JSONResponse(items_page(_store(request).get(response_id).input_items, q.get("limit"), q.get("order"),
                                   q.get("after")))


async def delete(request: Request, response_id: str) -> Response:
    _store(request).delete(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def responses_router(prefixes: tuple[str, ...] = ("/v1",)) -> APIRouter:
    router = APIRouter()
    for prefix in prefixes:
        router.add_api_route(f"{prefix}/responses", _openai_errors(create), methods=["POST"],
                             openapi_extra=json_body(ResponsesRequest), summary="Create a response")
        router.add_api_route(f"{prefix}/responses/{{response_id}}", _openai_errors(retrieve), methods=["GET"],
                             summary="A stored response")
        router.add_api_route(f"{prefix}/responses/{{response_id}}/input_items", _openai_errors(list_input_items),
                             methods=["GET"], summary="A stored response's input items")
        router.add_api_route(f"{prefix}/responses/{{response_id}}", _openai_errors(delete), methods=["DELETE"],
                             summary="Delete a stored response")
    return router


__all__ = ["ProtocolError", "responses_router"]
