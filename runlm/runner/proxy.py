"""Forwarding OpenAI requests to a model's backend, streamed through without buffering.

A backend that dies mid-answer is reported, never hung on: before headers the client gets a
503; inside a stream it gets an SSE ``error`` event (which the openai client raises).
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from runlm.runner.config import BackendMode, ConfigError, parse_keep_alive
from runlm.runner.errors import BackendUnavailable, BadRequest
from runlm.runner.loader import Loader
from runlm.runner.runner import Runner

DEATH_GRACE_SECONDS = 5.0
# never the client's Authorization: it is the daemon's key; backends get their own (runner.backend_client)
_FORWARDED_HEADERS = ("accept", "content-type")
MODES = {"embeddings": BackendMode.EMBEDDING, "rerank": BackendMode.RERANKING, "score": BackendMode.RERANKING,
         "images": BackendMode.IMAGE_GENERATION}


class BackendGone(BackendUnavailable):
    pass


async def backend_failed(runner: Runner, exc: Exception) -> BackendGone:
    """Wait until the loader has seen the process end (so the next request reloads), then explain."""
    if runner.task is not None and not runner.task.done():
        await asyncio.wait({runner.task}, timeout=DEATH_GRACE_SECONDS)
    why = runner.error.splitlines()[0] if runner.error else f"{type(exc).__name__}: {exc}"
    return BackendGone(f"the {runner.backend.name} backend serving {runner.model_ref!r} stopped while answering "
                       f"({why}); the model was unloaded and the next request loads it again", code="backend_died")


async def send(runner: Runner, method: str, path: str, body: dict | None = None,
               headers: dict[str, str] | None = None, stream: bool = False) -> httpx.Response:
    try:
        req = runner.client.build_request(method, path, json=body, headers=headers)
        return await runner.client.send(req, stream=stream)
    except (httpx.HTTPError, RuntimeError) as exc:  # RuntimeError: the client was closed by the process's death
        raise await backend_failed(runner, exc) from None


def sse_error(err: BackendUnavailable) -> bytes:
    return f"data: {json.dumps(err.body())}\n\n".encode()


async def sse_events(runner: Runner, resp: httpx.Response) -> AsyncIterator[dict]:
    """The JSON events of an OpenAI SSE stream; BackendGone if the stream breaks off."""
    try:
        async for line in resp.aiter_lines():
            if line.startswith("data:"):
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                yield json.loads(data)
    except (httpx.HTTPError, RuntimeError) as exc:
        raise await backend_failed(runner, exc) from None


def pop_keep_alive(body: dict) -> float | None:
    if "keep_alive" not in body:
        return None
    try:
        return parse_keep_alive(body.pop("keep_alive"))
    except ConfigError as exc:
        raise BadRequest(str(exc), param="keep_alive") from None


def require_model(body: object) -> str:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required: the name of a model (see GET /v1/models)", param="model")
    return model


@dataclass(slots=True)
class BackendAnswer:
    """A backend's answer, headers read and body not; ``release`` (idempotent) hands the model back."""
    runner: Runner
    resp: httpx.Response
    release: Callable[[], None]

    async def read(self) -> bytes:
        try:
            return await self.resp.aread()
        except (httpx.HTTPError, RuntimeError) as exc:
            raise await backend_failed(self.runner, exc) from None
        finally:
            await self.close()

    async def close(self) -> None:
        await self.resp.aclose()
        self.release()


async def post_to_backend(loader: Loader, route: str, body: dict, headers: dict[str, str],
                          backend: str | None = None) -> BackendAnswer:
    """POST /v1/<route> to the backend of the model the body names, loading it first when needed."""
    name = require_model(body)
    keep_alive = pop_keep_alive(body)
    mode = MODES.get(route.split("/")[0], BackendMode.COMPLETION)
    runner = await loader.acquire(name, backend, mode)
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            loader.release(runner, keep_alive)

    try:
        body["model"] = loader.served_name(name, runner)
        fwd = {k: v for k, v in headers.items() if k.lower() in _FORWARDED_HEADERS}
        resp = await send(runner, "POST", f"/v1/{route}", body, fwd, stream=True)
    except BaseException:
        release()
        raise
    return BackendAnswer(runner, resp, release)


async def forward_openai(loader: Loader, route: str, body: dict, headers: dict[str, str],
                         backend: str | None = None) -> Response:
    """POST /v1/<route> for the model the body names, streamed through as the backend answers."""
    answer = await post_to_backend(loader, route, body, headers, backend)
    resp, runner = answer.resp, answer.runner
    media = resp.headers.get("content-type", "application/json")
    if not media.startswith("text/event-stream"):
        return Response(await answer.read(), status_code=resp.status_code, media_type=media)

    async def passthrough() -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except (httpx.HTTPError, RuntimeError) as exc:
            yield sse_error(await backend_failed(runner, exc))
        finally:
            await answer.close()

    return StreamingResponse(passthrough(), status_code=resp.status_code, media_type=media,
                             background=BackgroundTask(answer.release))
