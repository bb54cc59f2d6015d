"""The app factory: ``build_app(settings, engine)`` for a loaded AsyncLLM (tests, embedding in other
programs), or ``build_app(settings, load_engine=...)`` to load it after the socket is open, so
``/liveness`` answers at once and ``/health`` and ``/readiness`` say 503 until the model is ready."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from runlm import __version__
from runlm.apis.anthropic import messages_router
from runlm.apis.anthropic_output import middleware_error
from runlm.apis.responses import responses_router
from runlm.apis.responses_store import ResponseStore
from runlm.engine.async_inproc import AsyncLLM
from runlm.server import chat, completions, engine_ops, infill, lora, meta, pooling, tokenize
from runlm.server.chat_source import EngineChatSource
from runlm.server.errors import install_error_handlers
from runlm.server.metrics import ServerMetrics
from runlm.server.state import ServerSettings, ServerState
from runlm.web.api_key import OPEN_PATHS, APIKeyMiddleware
from runlm.web.body_limit import BodyLimitMiddleware
from runlm.web.chat_page import PAGE_PATHS, page_router
from runlm.web.openapi import install_openapi

log = logging.getLogger("runlm.server")


def build_app(settings: ServerSettings, engine: AsyncLLM | None = None, *,
              load_engine: Callable[[], AsyncLLM] | None = None,
              on_load_error: Callable[[BaseException], None] | None = None,
              shutdown_engine: bool = True) -> FastAPI:
    if (engine is None) == (load_engine is None):
        raise ValueError("give either a loaded engine or load_engine")
    state: ServerState

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loader = None if load_engine is None else asyncio.create_task(_load(state, load_engine, on_load_error))
        if engine is not None:
            await lora.load_startup_adapters(state, engine)
        try:
            yield
        finally:
            if loader is not None:
                loader.cancel()
            if shutdown_engine and state.engine is not None:
                state.engine.shutdown()

    app = FastAPI(title="runlm", lifespan=lifespan, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    install_openapi(app, "runlm serve-engine", __version__,
                    "An OpenAI-compatible API over one model (runlm's engine); errors are OpenAI's shape.")
    state = ServerState(settings, ServerMetrics(settings.served_model_names[0], lambda: state.engine), engine)
    app.state.server = state
    install_error_handlers(app)
    app.state.chat_source, app.state.response_store = EngineChatSource, ResponseStore()
    app.include_router(responses_router())
    app.include_router(page_router("runlm serve-engine is running"))
    app.include_router(messages_router())
    # the fallback last: a pooling router goes before it
    for router in (chat.router, completions.router, infill.router, tokenize.router, meta.router, lora.router,
                   engine_ops.router, pooling.router, meta.fallback_router):
        app.include_router(router)
    # added innermost first: CORS outermost so preflights and error answers carry its headers
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes, write_error=middleware_error)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key, write_error=middleware_error,
                           open_paths=OPEN_PATHS | PAGE_PATHS)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    return app


async def _load(state: ServerState, load_engine: Callable[[], AsyncLLM],
                on_error: Callable[[BaseException], None] | None) -> None:
    try:
        engine = await asyncio.to_thread(load_engine)
        await lora.load_startup_adapters(state, engine)
        state.engine = engine
        log.info("model %s is ready", state.model_name)
    except Exception as exc:
        state.load_error = exc
        log.error("loading %s failed: %s", state.model_name, exc)
        if on_error is not None:
            on_error(exc)
