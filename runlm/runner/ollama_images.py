"""Ollama's image generation fields on /api/generate, for image-generation models: ``width``, ``height``,
``steps`` and ``options.seed`` in; ``image`` (base64 PNG) out, with ``completed`` / ``total`` steps on
the streamed lines before it. Translated onto the backend's POST /v1/images/generations stream."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from runlm.runner.config import BackendMode
from runlm.runner.errors import BackendUnavailable, BadRequest, RunnerError
from runlm.runner.ollama_convert import backend_error_message, now_iso
from runlm.runner.proxy import pop_keep_alive, send, sse_events
from runlm.web.disconnect import unless_disconnected

NDJSON = "application/x-ndjson"


def image_request(body: dict) -> dict[str, Any]:
    """The images API request for an Ollama /api/generate body (one image; a missing side copies the other)."""
    width, height = body.get("width") or body.get("height"), body.get("height") or body.get("width")
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'options' must be an object", param="options")
    out: dict[str, Any] = {"prompt": body["prompt"], "stream": True}
    if width:
        if not isinstance(width, int) or not isinstance(height, int):
            raise BadRequest("'width' and 'height' must be integers", param="width")
        out["size"] = f"{width}x{height}"
    for key, value in (("steps", body.get("steps")), ("seed", options.get("seed"))):
        if value is not None:
            out[key] = value
    return out


async def generate_image(request: Request, body: dict, name: str) -> Response:
    keep_alive = pop_keep_alive(body)
    loader = request.app.state.loader
    payload = image_request(body)
    t0 = time.monotonic()
    runner = await loader.acquire(name, None, BackendMode.IMAGE_GENERATION)
    t_loaded = time.monotonic()
    try:
        resp = await send(runner, "POST", "/v1/images/generations", {"model": runner.model_ref, **payload},
                          stream=True)
        if resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            raise RunnerError(backend_error_message(content), status=resp.status_code)
    except BaseException:
        loader.release(runner, keep_alive)
        raise

    async def lines() -> AsyncIterator[dict]:
        try:
            async for ev in sse_events(runner, resp):
                if ev.get("error"):
                    err = ev["error"]
                    yield {"error": err.get("message", str(err)) if isinstance(err, dict) else str(err)}
                    return
                if ev.get("type") == "image_generation.progress":
                    yield {"model": name, "created_at": now_iso(), "done": False, "completed": ev["step"],
                           "total": ev["total_steps"]}
                elif ev.get("type") == "image_generation.completed":
                    ns = 1_000_000_000
                    yield {"model": name, "created_at": now_iso(), "response": "", "done": True,
                           "done_reason": "stop", "image": ev["b64_json"],
                           "total_duration": int((time.monotonic() - t0) * ns),
                           "load_duration": int((t_loaded - t0) * ns)}
        except BackendUnavailable as exc:
            yield {"error": exc.message}
        finally:
            await resp.aclose()
            loader.release(runner, keep_alive)

    if body.get("stream", True) is not False:
        async def ndjson() -> AsyncIterator[bytes]:
            async for line in lines():
                yield (json.dumps(line) + "\n").encode()
        return StreamingResponse(ndjson(), media_type=NDJSON)
    return await unless_disconnected(request, _last(lines()))


async def _last(lines: AsyncIterator[dict]) -> JSONResponse:
    final: dict = {}
    async for line in lines:
        if "error" in line:
            return JSONResponse({"error": line["error"]}, status_code=503)
        final = line
    return JSONResponse(final)
