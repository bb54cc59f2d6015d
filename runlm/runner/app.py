"""The daemon's HTTP app: Docker Model Runner, OpenAI and Ollama routes over one loader and store."""
from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response
from starlette.types import Scope

from runlm import __version__
from runlm.apis.anthropic import messages_router
from runlm.apis.anthropic_output import error_body as anthropic_error_body
from runlm.apis.anthropic_output import is_anthropic_path
from runlm.apis.responses import responses_router
from runlm.apis.responses_store import ResponseStore
from runlm.runner import engines_api, models_api, ollama_api, ollama_create
from runlm.runner.backends import all_backends
from runlm.runner.chat_source import BackendChatSource
from runlm.runner.engines_api import OPENAI_PREFIXES
from runlm.runner.errors import RunnerError, error_body
from runlm.runner.loader import Loader
from runlm.runner.memory import MemoryBudget
from runlm.store import ModelStore, NameConflictError
from runlm.store.sources import LocalAccess
from runlm.web.api_key import APIKeyMiddleware
from runlm.web.body_limit import DEFAULT_MAX_BODY, BodyLimitMiddleware
from runlm.web.browser_guard import BrowserGuardMiddleware, BrowserPolicy
from runlm.web.chat_page import PAGE_PATHS, page_router
from runlm.web.disconnect import ClientDisconnected
from runlm.web.openapi import install_openapi

log = logging.getLogger("runlm.runner")


def _shaped(path: str, body: dict, status: int) -> dict:
    # Ollama's clients read {"error": "message"}, Anthropic's {"type": "error", ...}; the rest the OpenAI shape
    if path.startswith("/api/"):
        return {"error": body["error"]["message"]}
    return anthropic_error_body(status, body["error"]["message"]) if is_anthropic_path(path) else body


def _error(request: Request, status: int, body: dict) -> JSONResponse:
    return JSONResponse(_shaped(request.url.path, body, status), status_code=status)


def _middleware_error(scope: Scope, status: int, message: str, code: str) -> bytes:
    kind = {401: "authentication_error", 403: "permission_error"}.get(
        status, "invalid_request_error" if status < 500 else "internal_error")
    return json.dumps(_shaped(scope["path"], error_body(message, kind, code=code), status)).encode()


@dataclass(slots=True, frozen=True)
class HTTPSettings:
    """How the daemon meets HTTP: where it is bound, whom it answers, how much it reads."""
    host: str = "127.0.0.1"
    allowed_hosts: frozenset[str] = frozenset()
    allowed_origins: frozenset[str] = frozenset()
    max_body_bytes: int = DEFAULT_MAX_BODY


def create_app(store: ModelStore, budget: MemoryBudget | None = None, keep_alive: float | None = None,
               api_key: str | tuple[str, ...] | None = None, allow_local_import: Path | None = None,
               http: HTTPSettings | None = None) -> FastAPI:
    backends = all_backends(store.logs)
    loader = Loader(store, backends, budget or MemoryBudget.default(),
                    **({"default_keep_alive": keep_alive} if keep_alive is not None else {}))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await loader.start()
        try:
            yield
        finally:
            await loader.close()  # no backend process outlives the daemon

    app = FastAPI(title="runlm", lifespan=lifespan, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    install_openapi(app, "runlm serve", __version__, "runlm's daemon: Docker Model Runner, OpenAI and Ollama routes "
                    "over one model store. Errors: OpenAI's shape; Ollama's {\"error\": \"...\"} under /api.")
    app.state.store, app.state.loader = store, loader
    app.state.local_access = LocalAccess.under(allow_local_import)  # none unless the operator named a folder

    @app.exception_handler(RunnerError)
    async def runner_error(request: Request, exc: RunnerError) -> JSONResponse:
        return _error(request, exc.status, exc.body())

    @app.exception_handler(NameConflictError)
    async def name_conflict(request: Request, exc: NameConflictError) -> JSONResponse:
        return _error(request, 409, error_body(str(exc), "conflict_error", code="name_conflict"))

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return _error(request, exc.status_code, error_body(message, kind))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(request, 400, error_body(str(exc)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return _error(request, 500, error_body(f"internal error: {type(exc).__name__}: {exc}", "internal_error"))

    app.include_router(page_router("runlm is running"))
    app.state.chat_source, app.state.response_store = BackendChatSource, ResponseStore()
    app.include_router(responses_router(OPENAI_PREFIXES))  # before engines_api's catch-all /v1/{route}
    app.include_router(messages_router(OPENAI_PREFIXES))
    app.include_router(models_api.router)
    app.include_router(engines_api.router)
    app.include_router(ollama_api.router)
    app.include_router(ollama_create.router)
    http = http or HTTPSettings()
    # added innermost first: the browser guard runs before anything reads the body or the key
    app.add_middleware(BodyLimitMiddleware, limit=http.max_body_bytes, write_error=_middleware_error)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key,
                           open_paths=frozenset({"/api/version", "/openapi.json", "/docs"}) | PAGE_PATHS,
                           write_error=_middleware_error)
    app.add_middleware(BrowserGuardMiddleware, write_error=_middleware_error,
                       policy=BrowserPolicy(http.host, http.allowed_hosts, http.allowed_origins))
    if http.allowed_origins:  # pages of those origins may also read the answers
        app.add_middleware(CORSMiddleware, allow_origins=sorted(http.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    return app
