"""Docker Model Runner's inference routes (/engines/...), their /v1 aliases, and /metrics."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from runlm.runner.config import BackendConfig, ConfigError
from runlm.runner.errors import BadRequest, Conflict, NotFound
from runlm.runner.metrics import aggregate
from runlm.runner.models_api import body_json, delete_model, get_model
from runlm.runner.proxy import forward_openai, require_model
from runlm.runner.requests import ConfigureRequest, OpenAIRequest, UnloadRequest
from runlm.runner.views import unix_time
from runlm.store.capabilities import capabilities, input_modalities
from runlm.web.disconnect import unless_disconnected
from runlm.web.openapi import json_body

router = APIRouter()
# where the daemon answers OpenAI's API: Model Runner's paths and the plain /v1 alias
OPENAI_PREFIXES = ("/v1", "/engines/v1", "/engines/{backend}/v1")
OPENAI_POST_ROUTES = ("chat/completions", "completions", "embeddings", "rerank", "score", "images/generations")


def _check_backend(request: Request, backend: str | None) -> str | None:
    if backend is not None and backend not in request.app.state.loader.backends:
        raise NotFound(f"unknown backend {backend!r} (backends: {', '.join(request.app.state.loader.backends)})")
    return backend


async def _openai_post(request: Request, route: str, backend: str | None) -> Response:
    if route not in OPENAI_POST_ROUTES:
        raise NotFound(f"no route POST /v1/{route}")
    body = await body_json(request, OpenAIRequest)
    # until headers come back (a whole answer, when not streamed) a client that leaves cancels the request
    return await unless_disconnected(request, forward_openai(request.app.state.loader, route, body,
                                                             dict(request.headers), _check_backend(request, backend)))


async def _openai_models(request: Request, name: str | None) -> JSONResponse:
    store = request.app.state.store
    models = await asyncio.to_thread(store.list)
    data = [{"id": str(m.name), "object": "model", "created": unix_time(m.created), "owned_by": "runlm",
             "capabilities": capabilities(m), "input_modalities": input_modalities(m)} for m in models]
    if name is None:
        return JSONResponse({"object": "list", "data": data})
    for d in data:
        if d["id"] == name or d["id"] == f"{name}:latest":
            return JSONResponse(d)
    raise NotFound(f"model {name!r} not found", param="model", code="model_not_found")


@router.post("/v1/{route:path}", openapi_extra=json_body(OpenAIRequest))
@router.post("/engines/v1/{route:path}", openapi_extra=json_body(OpenAIRequest))
async def openai_post(request: Request, route: str) -> Response:
    return await _openai_post(request, route, None)


@router.post("/engines/{backend}/v1/{route:path}", openapi_extra=json_body(OpenAIRequest))
async def openai_post_backend(request: Request, backend: str, route: str) -> Response:
    return await _openai_post(request, route, backend)


@router.get("/v1/models", openapi_extra=json_body())
@router.get("/engines/v1/models", openapi_extra=json_body())
@router.get("/engines/{backend}/v1/models", openapi_extra=json_body())
async def openai_models(request: Request, backend: str | None = None) -> JSONResponse:
    _check_backend(request, backend)
    return await _openai_models(request, None)


@router.get("/v1/models/{name:path}", openapi_extra=json_body())
@router.get("/engines/v1/models/{name:path}", openapi_extra=json_body())
@router.get("/engines/{backend}/v1/models/{name:path}", openapi_extra=json_body())
async def openai_model(request: Request, name: str, backend: str | None = None) -> JSONResponse:
    _check_backend(request, backend)
    return await _openai_models(request, name)


@router.delete("/v1/models/{name:path}", openapi_extra=json_body())
@router.delete("/engines/v1/models/{name:path}", openapi_extra=json_body())
@router.delete("/engines/{backend}/v1/models/{name:path}", openapi_extra=json_body())
async def delete_openai_model(request: Request, name: str, backend: str | None = None) -> JSONResponse:
    """OpenAI's model deletion (the founding Go server's route): unloads and deletes the stored model; a model
    that requests are using (or that is loading) is a 409, as DELETE /models/{name} says."""
    _check_backend(request, backend)
    model = await get_model(request, name)
    runners = request.app.state.loader.runners.values()
    busy = [r for r in runners if r.model.id == model.id and (r.in_use or not r.ready)]
    if busy:
        raise Conflict(f"model {str(model.name)!r} is in use ({sum(r.in_use for r in busy)} requests running, or it is "
                       f"loading); delete it when they are done", param="model", code="model_in_use")
    deleted = await delete_model(request, name, force=True)
    return JSONResponse({"id": str(deleted.name), "object": "model", "deleted": True})


@router.get("/engines/status", openapi_extra=json_body())
async def status(request: Request) -> JSONResponse:
    return JSONResponse({name: b.status() for name, b in request.app.state.loader.backends.items()})


@router.get("/engines/ps", openapi_extra=json_body())
async def ps(request: Request) -> JSONResponse:
    return JSONResponse([r.to_json() for r in request.app.state.loader.runners.values()])


@router.get("/engines/df", openapi_extra=json_body())
async def df(request: Request) -> JSONResponse:
    usage = await asyncio.to_thread(request.app.state.store.disk_usage)
    backends = {n: b.disk_usage() for n, b in request.app.state.loader.backends.items()}
    return JSONResponse({"models_disk_usage": usage["models"], "partial_downloads": usage["partial"],
                         "default_backend_disk_usage": backends["native"], "backends_disk_usage": backends})


@router.post("/engines/unload", openapi_extra=json_body(UnloadRequest))
async def unload(request: Request) -> JSONResponse:
    body = await body_json(request, UnloadRequest)
    models = body.get("models")
    if body.get("all"):
        models = None
    elif not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise BadRequest("give {'models': [NAME, ...]} or {'all': true}", param="models")
    count = await request.app.state.loader.unload_models(models, _check_backend(request, body.get("backend")))
    return JSONResponse({"unloaded_runners": count})


@router.post("/engines/_configure", openapi_extra=json_body(ConfigureRequest))
@router.post("/engines/{backend}/_configure", openapi_extra=json_body(ConfigureRequest))
async def configure(request: Request, backend: str | None = None) -> JSONResponse:
    body = await body_json(request, ConfigureRequest)
    name = require_model(body)
    loader = request.app.state.loader
    model = await loader.model(name)
    try:
        config = BackendConfig.from_json(body)
        loader.backend(_check_backend(request, backend), model).check_config(config)
    except ConfigError as exc:
        raise BadRequest(str(exc)) from None
    chosen = await loader.configure(model, backend, config)
    return JSONResponse({"model": str(model.name), "backend": chosen.name, "config": config.to_json()},
                        status_code=202)


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    return PlainTextResponse(await aggregate(request.app.state.loader),
                             media_type="text/plain; version=0.0.4; charset=utf-8")
