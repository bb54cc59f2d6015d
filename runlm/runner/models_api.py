"""Docker Model Runner's model routes: /models (create = pull, list, inspect, delete, tag)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.responses import JSONResponse, Response, StreamingResponse

from runlm.runner.errors import BadRequest, Conflict, NotFound
from runlm.runner.ollama_stream import NDJSON, ndjson_line
from runlm.runner.pulling import pull_events, refused_before_streaming, transfer_events
from runlm.runner.requests import CreateRequest, PushRequest, TagRequest
from runlm.runner.views import group_by_id, model_json
from runlm.store import InvalidNameError, ModelNotFoundError, StoredModel
from runlm.store.capabilities import capabilities, input_modalities
from runlm.store.progress import PullProgress
from runlm.web.json_body import JSONBodyError, parse_json_object, validate_body
from runlm.web.openapi import json_body


async def get_model(request: Request, name: str) -> StoredModel:
    try:
        return await asyncio.to_thread(request.app.state.store.get, name)
    except InvalidNameError as exc:
        raise BadRequest(str(exc), param="name") from None
    except ModelNotFoundError as exc:
        raise NotFound(str(exc), code="model_not_found") from None


async def body_json(request: Request, model: type[BaseModel] | None = None) -> dict:
    """The body as a JSON object, parsed as serve-engine parses it (an empty body is {}), and checked against the
    route's request ``model`` (runlm/runner/requests.py; /openapi.json documents the same)."""
    try:
        body = parse_json_object(await request.body(), empty={})
        if model is not None:
            validate_body(model, body)
    except JSONBodyError as exc:
        raise BadRequest(str(exc), param=exc.param) from None
    return body


router = APIRouter()


@router.post("/models/create", openapi_extra=json_body(CreateRequest))
async def create(request: Request) -> Response:
    body = await body_json(request, CreateRequest)
    source = body.get("from")
    if not isinstance(source, str) or not source:
        raise BadRequest("'from' is required: a built-in name, a file, a URL or a Hugging Face repo id", param="from")
    store = request.app.state.store
    events = await refused_before_streaming(pull_events(store, source, body.get("name"), request.app.state.local_access,
                                                        insecure=bool(body.get("insecure"))))

    async def lines() -> AsyncIterator[bytes]:
        async for item in events:
            if isinstance(item, PullProgress):
                msg = {"type": "progress", "message": item.status, "total": item.total, "pulled": item.completed}
            elif isinstance(item, Exception):
                msg = {"type": "error", "message": str(item)}
            else:
                msg = {"type": "success", "message": f"pulled {item.name}", "id": item.id}
            yield ndjson_line(msg)

    return StreamingResponse(lines(), media_type=NDJSON)


@router.post("/models/{name:path}/push", openapi_extra=json_body(PushRequest, required=False))
async def push(request: Request, name: str) -> Response:
    """Push a stored model to a registry (``target``, or the reference it came from), streaming progress."""
    from runlm.store.oci.transfer import push as push_model

    body = await body_json(request, PushRequest)
    model = await get_model(request, name)
    store, target, insecure = request.app.state.store, body.get("target"), bool(body.get("insecure"))

    events = await refused_before_streaming(
        transfer_events(lambda put: push_model(store, str(model.name), target, insecure, put)))

    async def lines() -> AsyncIterator[bytes]:
        async for item in events:
            if isinstance(item, PullProgress):
                msg = {"type": "progress", "message": item.status, "total": item.total, "pushed": item.completed}
            elif isinstance(item, Exception):
                msg = {"type": "error", "message": str(item)}
            else:
                ref, digest = item
                msg = {"type": "success", "message": f"pushed {ref}", "digest": digest}
            yield ndjson_line(msg)

    return StreamingResponse(lines(), media_type=NDJSON)


@router.get("/models", openapi_extra=json_body())
async def list_models(request: Request) -> JSONResponse:
    models = await asyncio.to_thread(request.app.state.store.list)
    return JSONResponse([model_json(g) for g in group_by_id(models)])


@router.post("/models/{name:path}/tag", openapi_extra=json_body(TagRequest, required=False))
async def tag(request: Request, name: str) -> JSONResponse:
    body = await body_json(request, TagRequest)
    target = body.get("target")
    if target is None and request.query_params.get("repo"):
        target = f"{request.query_params['repo']}:{request.query_params.get('tag', 'latest')}"
    if not isinstance(target, str):
        raise BadRequest("give the new name as ?repo=NAME&tag=TAG or {\"target\": \"name:tag\"}", param="target")
    await get_model(request, name)
    try:
        model = await asyncio.to_thread(request.app.state.store.tag, name, target)
    except InvalidNameError as exc:
        raise BadRequest(str(exc), param="target") from None
    return JSONResponse({"message": f"tagged {name} as {model.name}", "id": model.id}, status_code=201)


@router.get("/models/{name:path}", openapi_extra=json_body())
async def inspect(request: Request, name: str) -> JSONResponse:
    model = await get_model(request, name)
    tags = [m for m in await asyncio.to_thread(request.app.state.store.list) if m.id == model.id]
    out = model_json(tags)
    out["config"]["template"] = model.info.template
    out["config"]["capabilities"] = capabilities(model)
    out["config"]["input_modalities"] = input_modalities(model)
    return JSONResponse(out)


async def delete_model(request: Request, name: str, force: bool) -> StoredModel:
    model = await get_model(request, name)
    loader = request.app.state.loader
    others = [m for m in await asyncio.to_thread(request.app.state.store.list)
              if m.id == model.id and m.name != model.name]
    if loader.is_loaded(model) and not others:
        if not force:
            raise Conflict(f"model {str(model.name)!r} is loaded; unload it first (runlm stop {model.name}) "
                           f"or delete with force", code="model_loaded")
        await loader.unload_models([str(model.name)])
    elif others:  # the name goes, the weights stay: an idle copy loaded under that name goes with it (else it would
        await loader.unload_idle_named(model.name)  # serve, and list, a name that no longer exists)
    return await asyncio.to_thread(request.app.state.store.remove, str(model.name))


@router.delete("/models/{name:path}", openapi_extra=json_body())
async def delete(request: Request, name: str) -> JSONResponse:
    force = request.query_params.get("force", "").lower() in ("1", "true", "yes")
    model = await delete_model(request, name, force)
    return JSONResponse({"message": f"deleted {model.name}", "id": model.id})
