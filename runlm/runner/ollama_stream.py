"""What Ollama's streamed routes share: one backend SSE stream opened for a request, and the answer as
NDJSON lines (``stream`` true, Ollama's default) or one object."""
from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable

import httpx
from fastapi import Request
from starlette.responses import Response, StreamingResponse

from runlm.runner.config import BackendMode
from runlm.runner.errors import BackendUnavailable, RunnerError
from runlm.runner.loader import Loader
from runlm.runner.ollama_convert import backend_error_message
from runlm.runner.ollama_options import LoadOptions
from runlm.runner.proxy import send, sse_events
from runlm.runner.runner import Runner
from runlm.web.disconnect import unless_disconnected

NDJSON = "application/x-ndjson"


def ndjson_line(obj: dict) -> bytes:
    return (json.dumps(obj) + "\n").encode()


async def open_stream(loader: Loader, name: str, mode: BackendMode, path: str, payload: dict,
                      keep_alive: float | None, load: LoadOptions | None = None) -> tuple[Runner, httpx.Response]:
    """The model's runner (held: the caller releases it; loaded as ``load`` asks) and its backend's answer to
    ``payload``, streamed; a backend's error answer is raised as that error."""
    runner = await loader.acquire(name, None, mode, load)
    try:
        resp = await send(runner, "POST", path, {**payload, "model": loader.served_name(name, runner)}, stream=True)
        if resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            raise RunnerError(backend_error_message(content), status=resp.status_code)
    except BaseException:
        loader.release(runner, keep_alive)
        raise
    return runner, resp


async def events(loader: Loader, runner: Runner, resp: httpx.Response,
                 keep_alive: float | None) -> AsyncGenerator[dict, None]:
    """The backend stream's events; a failure ends them with Ollama's ``{"error": message}``. Once they end (or
    the caller closes them) the stream is closed and the runner released."""
    try:
        async for ev in sse_events(runner, resp):
            if ev.get("error"):
                err = ev["error"]
                yield {"error": err.get("message", str(err)) if isinstance(err, dict) else str(err)}
                return
            yield ev
    except BackendUnavailable as exc:
        yield {"error": exc.message}
    finally:
        await resp.aclose()
        loader.release(runner, keep_alive)


async def answer(request: Request, body: dict, chunks: AsyncGenerator[dict, None],
                 whole: Callable[[AsyncGenerator[dict, None]], Awaitable[Response]]) -> Response:
    """NDJSON lines as they come, or (``"stream": false``) what ``whole`` makes of them all."""
    if body.get("stream", True) is not False:
        async def lines() -> AsyncGenerator[bytes, None]:
            async for c in chunks:
                yield ndjson_line(c)
        return StreamingResponse(lines(), media_type=NDJSON)
    return await unless_disconnected(request, whole(chunks))
