"""The daemon's HTTP app: Docker Model Runner, OpenAI and Ollama routes over one loader and store."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse

from runlm.runner import engines_api, models_api, ollama_api
from runlm.runner.backends import all_backends
from runlm.runner.errors import RunnerError, error_body
from runlm.runner.loader import Loader
from runlm.runner.memory import MemoryBudget
from runlm.store import ModelStore
from runlm.store.sources import LocalAccess

log = logging.getLogger("runlm.runner")


def _error(request: Request, status: int, body: dict) -> JSONResponse:
    # Ollama's clients read {"error": "message"}; everything else gets the OpenAI shape
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": body["error"]["message"]}, status_code=status)
    return JSONResponse(body, status_code=status)


def create_app(store: ModelStore, budget: MemoryBudget | None = None, keep_alive: float | None = None,
               api_key: str | None = None, allow_local_import: Path | None = None) -> FastAPI:
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

    app = FastAPI(title="runlm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.store, app.state.loader = store, loader
    app.state.local_access = LocalAccess.under(allow_local_import)  # none unless the operator named a folder

    @app.exception_handler(RunnerError)
    async def runner_error(request: Request, exc: RunnerError) -> JSONResponse:
        return _error(request, exc.status, exc.body())

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

    if api_key:
        @app.middleware("http")
        async def check_key(request: Request, call_next):  # type: ignore[no-untyped-def]
            if request.url.path not in ("/", "/api/version") and \
                    request.headers.get("authorization") != f"Bearer {api_key}":
                return _error(request, 401, error_body("missing or wrong API key (Authorization: Bearer KEY)",
                                                       "authentication_error"))
            return await call_next(request)

    @app.get("/")
    async def root() -> PlainTextResponse:
        return PlainTextResponse("runlm is running")

    app.include_router(models_api.router)
    app.include_router(engines_api.router)
    app.include_router(ollama_api.router)
    return app
