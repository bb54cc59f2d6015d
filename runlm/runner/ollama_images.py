"""Ollama's image generation fields on /api/generate, for image-generation models: ``width``, ``height``,
``steps`` and ``options.seed`` in; ``image`` (base64 PNG) out, with ``completed`` / ``total`` steps on
the streamed lines before it. Translated onto the backend's POST /v1/images/generations stream."""
from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from starlette.responses import JSONResponse, Response

from runlm.runner.config import BackendMode
from runlm.runner.errors import BadRequest
from runlm.runner.ollama_convert import now_iso
from runlm.runner.ollama_stream import answer, events, open_stream
from runlm.runner.proxy import pop_keep_alive


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
    runner, resp = await open_stream(loader, name, BackendMode.IMAGE_GENERATION, "/v1/images/generations",
                                     payload, keep_alive)
    t_loaded = time.monotonic()

    async def lines() -> AsyncGenerator[dict, None]:
        async with contextlib.aclosing(events(loader, runner, resp, keep_alive)) as evs:
            async for ev in evs:
                if ev.get("error"):
                    yield ev
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

    return await answer(request, body, lines(), _last)


async def _last(lines: AsyncGenerator[dict, None]) -> Response:
    final: dict = {}
    async for line in lines:
        if "error" in line:
            return JSONResponse({"error": line["error"]}, status_code=503)
        final = line
    return JSONResponse(final)
