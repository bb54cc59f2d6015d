"""Routes about the server rather than generation: models, health, readiness, version, metrics."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from runlm import __version__
from runlm.server.errors import APIError, error_response
from runlm.server.lora import adapter_cards
from runlm.server.metrics import CONTENT_TYPE
from runlm.server.state import ServerState

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    card: dict[str, Any] = {"id": name, "object": "model", "created": state.created, "owned_by": "runlm",
                            "root": state.model_name, "parent": None}
    if state.engine is not None:
        card["max_model_len"] = state.engine.max_model_len
        card["capabilities"] = capabilities(state.engine)
    return card


def capabilities(engine: Any) -> list[str]:
    """What the model does, in Ollama's names: "completion" or "embedding", and "vision" when it takes images."""
    tasks = engine.get_supported_tasks()
    caps = ["completion"] if "generate" in tasks else ["embedding"]
    if "image" in getattr(engine, "modalities", ("text",)):
        caps.append("vision")
    return caps


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    state = _state(request)
    cards = [_model_card(state, n) for n in state.settings.served_model_names]
    return JSONResponse({"object": "list", "data": cards + adapter_cards(state, state.created)})


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> JSONResponse:
    state = _state(request)
    adapter = next((c for c in adapter_cards(state, state.created) if c["id"] == model_id), None)
    if adapter is not None:
        return JSONResponse(adapter)
    if model_id not in state.settings.served_model_names:
        raise APIError(404, f"The model {model_id!r} does not exist", param="model", code="model_not_found")
    return JSONResponse(_model_card(state, model_id))


@router.delete("/v1/models/{model_id:path}")
async def delete_model(request: Request, model_id: str) -> JSONResponse:
    """The daemon deletes stored models; this server only serves one, which it cannot delete."""
    state = _state(request)
    raise APIError(405, f"runlm serve-engine serves the model {state.model_name!r} and cannot delete it; delete "
                        f"stored models on the daemon (runlm rm, or DELETE /v1/models/{{id}} on runlm serve)",
                   param="model", code="method_not_allowed", headers={"Allow": "GET"})


def _health(state: ServerState) -> Response:
    if state.draining:
        return error_response(503, "the server is shutting down", code="shutting_down")
    if state.engine is None:
        why = f"the model failed to load: {state.load_error}" if state.load_error else "the model is loading"
        return error_response(503, why, code="model_not_ready", headers={"Retry-After": "1"})
    try:
        state.engine.check_health_now()
    except Exception as exc:
        return error_response(503, str(exc), code="engine_dead")
    return JSONResponse({"status": "ok", "model": state.model_name})


@router.get("/health")
async def health(request: Request) -> Response:
    """200 once the model is loaded and the engine is alive; 503 before, and after it dies."""
    return _health(_state(request))


@router.get("/readiness")
async def readiness(request: Request) -> Response:
    return _health(_state(request))


@router.get("/liveness")
async def liveness() -> JSONResponse:
    """The process answers; says nothing about the model (see /readiness)."""
    return JSONResponse({"status": "alive"})


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


# Routes of tasks this model lacks. The pooling router (embeddings, rerank), when mounted, is
# included before this one, so its /v1/embeddings wins and this answer stays for generative models.
fallback_router = APIRouter()


@fallback_router.post("/v1/embeddings", include_in_schema=False)  # the pooling router documents it
async def embeddings_unsupported(request: Request) -> Response:
    _state(request).ready_engine()
    raise APIError(400, "this model does not support embeddings", param="model", code="unsupported_task")
