"""The diffusers backend's HTTP server: OpenAI's images API over one pipeline, on a Unix socket.

One worker thread runs the pipeline (a pipeline is not thread-safe, and one batch already uses
every core); requests wait their turn, and beyond ``max_waiting`` get a 503. A request whose client
leaves stops at the next denoising step. Progress (step k of n) goes to the log, and to the
client as ``image_generation.progress`` events when it asked for ``stream``.
"""
from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from runlm import __version__
from runlm.image_generation.pipeline import GeneratedImage, GenerationCancelled, ImageGenerator, StepCallback
from runlm.image_generation.request import MAX_SIDE, ImageRequest, ImageRequestError, parse_request
from runlm.server.errors import APIError, install_error_handlers, not_ready
from runlm.server.sse import DONE, HEADERS, error_event, event
from runlm.web.api_key import APIKeyMiddleware
from runlm.web.body_limit import DEFAULT_MAX_BODY, BodyLimitMiddleware
from runlm.web.disconnect import ClientDisconnected, unless_disconnected

log = logging.getLogger("runlm.image_generation")
router = APIRouter()


@dataclass(slots=True)
class ImageServer:
    model_name: str
    max_waiting: int = 8
    max_side: int = MAX_SIDE
    generator: ImageGenerator | None = None
    load_error: BaseException | None = None
    queued: int = 0  # requests admitted and not finished (the one running included)
    worker: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="diffusers"))

    def ready(self) -> ImageGenerator:
        if self.generator is None:
            if self.load_error is not None:
                raise APIError(503, f"the pipeline failed to load: {self.load_error}", code="model_load_failed")
            raise not_ready()
        return self.generator

    def check_model(self, requested: Any) -> None:
        if requested is not None and requested != self.model_name:
            raise APIError(421, f"this server serves the model {self.model_name!r}, not {requested!r}",
                           param="model", code="model_not_served")


class Job:
    """One request's turn on the worker: it can be cancelled before or while it runs."""

    def __init__(self, server: ImageServer, req: ImageRequest, on_step: StepCallback | None = None) -> None:
        self.server, self.req, self.on_step = server, req, on_step
        self.cancel = threading.Event()

    def _run(self, generator: ImageGenerator) -> list[GeneratedImage]:
        if self.cancel.is_set():
            raise GenerationCancelled
        return generator.generate(self.req, self.on_step, self.cancel.is_set)

    async def run(self, generator: ImageGenerator) -> list[GeneratedImage]:
        future = asyncio.get_running_loop().run_in_executor(self.server.worker, self._run, generator)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            self.cancel.set()  # the worker stops at the next step; the next request waits for that
            future.add_done_callback(lambda f: f.cancelled() or f.exception())  # its GenerationCancelled: expected
            raise


def image_json(img: GeneratedImage) -> dict[str, Any]:
    return {"b64_json": base64.b64encode(img.data).decode(), "revised_prompt": None, "seed": img.seed}


def _admit(state: ImageServer, body: Any) -> tuple[ImageGenerator, ImageRequest]:
    generator = state.ready()
    if isinstance(body, dict):
        state.check_model(body.get("model"))
    try:
        req = generator.resolve(parse_request(body, state.max_side))
    except ImageRequestError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
    if state.queued > state.max_waiting:
        raise APIError(503, f"{state.queued} image requests are already waiting; retry shortly", code="busy",
                       headers={"Retry-After": "2"})
    return generator, req


@router.post("/v1/images/generations")
async def generations(request: Request) -> Response:
    state: ImageServer = request.app.state.images
    try:
        body = await request.json()
    except ValueError:
        raise APIError(400, "the request body is not valid JSON") from None
    generator, req = _admit(state, body)
    created = int(time.time())
    if req.stream:
        return StreamingResponse(_stream(state, generator, req, created), media_type="text/event-stream",
                                 headers=HEADERS)
    state.queued += 1
    try:
        images = await unless_disconnected(request, Job(state, req).run(generator))
    except (ClientDisconnected, asyncio.CancelledError):
        raise
    except Exception as exc:  # the pipeline's own failure (out of memory, a bad component): this request's only
        log.exception("image generation failed")
        raise APIError(500, f"image generation failed: {type(exc).__name__}: {exc}", code="generation_failed") \
            from None
    finally:
        state.queued -= 1
    return JSONResponse({"created": created, "data": [image_json(i) for i in images], "size": req.size,
                         "output_format": req.output_format})


def _usage() -> dict[str, Any]:
    # OpenAI counts image tokens; a diffusion pipeline has none to count
    return {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
            "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}}


def _sse(payload: dict[str, Any]) -> str:
    return f"event: {payload['type']}\n" + event(payload)


async def _stream(state: ImageServer, generator: ImageGenerator, req: ImageRequest, created: int) -> AsyncIterator[str]:
    """OpenAI's image stream: progress events while the pipeline denoises, one completed event per image."""
    loop = asyncio.get_running_loop()
    steps: asyncio.Queue[tuple[int, int]] = asyncio.Queue()

    def on_step(k: int, n: int) -> None:  # on the worker thread
        loop.call_soon_threadsafe(steps.put_nowait, (k, n))

    job = Job(state, req, on_step)
    state.queued += 1
    task = asyncio.ensure_future(job.run(generator))
    try:
        while not task.done() or not steps.empty():
            getter = asyncio.ensure_future(steps.get())
            await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                continue
            k, n = getter.result()
            yield _sse({"type": "image_generation.progress", "step": k, "total_steps": n, "created_at": created})
        try:
            images = task.result()
        except Exception as exc:
            log.exception("image generation failed")
            yield error_event(APIError(500, f"image generation failed: {type(exc).__name__}: {exc}",
                                       code="generation_failed"))
            return
        for i, img in enumerate(images):
            yield _sse({"type": "image_generation.completed", "b64_json": image_json(img)["b64_json"],
                        "created_at": created, "size": f"{img.width}x{img.height}", "quality": "auto",
                        "background": "opaque", "output_format": req.output_format, "usage": _usage(),
                        "image_index": i, "seed": img.seed})
        yield DONE
    finally:
        state.queued -= 1
        if not task.done():  # the client left: stop the pipeline at its next step
            task.cancel()


@router.get("/health")
async def health(request: Request) -> Response:
    request.app.state.images.ready()
    return Response(status_code=200)


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    state: ImageServer = request.app.state.images
    return JSONResponse({"object": "list", "data": [{"id": state.model_name, "object": "model",
                                                     "owned_by": "runlm"}]})


def build_app(state: ImageServer, load: Callable[[], ImageGenerator] | None = None,
              api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY,
              on_load_error: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The app over ``state``; with ``load``, the pipeline loads after the socket is open (/health says 503
    until then)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(_load(state, load, on_load_error)) if load is not None else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
            state.worker.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="runlm diffusers backend", version=__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    app.state.images = state
    install_error_handlers(app)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; the pipeline stopped at its next step

    app.include_router(router)
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


async def _load(state: ImageServer, load: Callable[[], ImageGenerator] | None,
                on_error: Callable[[BaseException], None] | None) -> None:
    assert load is not None
    try:
        state.generator = await asyncio.get_running_loop().run_in_executor(state.worker, load)
        log.info("pipeline %s (%s) is ready", state.model_name, state.generator.class_name)
    except Exception as exc:
        state.load_error = exc
        log.error("loading %s failed: %s", state.model_name, exc)
        if on_error is not None:
            on_error(exc)
