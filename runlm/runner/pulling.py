"""Pulls run in threads of their own, a few at a time; their progress comes back to the event loop as a stream
of events. They never use the default executor, so stalled downloads cannot starve model loads (which do)."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from starlette.responses import JSONResponse, Response, StreamingResponse

from runlm.runner.errors import Busy, RunnerError
from runlm.runner.ollama_stream import NDJSON, ndjson_line
from runlm.store import InvalidNameError, ModelNotFoundError, ModelStore, NameConflictError, StoredModel
from runlm.store.progress import ProgressCallback, PullProgress
from runlm.store.sources import LocalAccess, SourceError

MAX_PULLS = 4           # downloads at once; the rest wait their turn
MAX_WAITING_PULLS = 32  # beyond running + waiting, a pull is refused (503) rather than queued
_slots = threading.BoundedSemaphore(MAX_PULLS)
_lock = threading.Lock()
_pending = 0  # pull threads alive (running or waiting for a slot), whether or not their client stayed


def _claim() -> bool:
    global _pending
    with _lock:
        if _pending >= MAX_PULLS + MAX_WAITING_PULLS:
            return False
        _pending += 1
        return True


def _unclaim() -> None:
    global _pending
    with _lock:
        _pending -= 1


def pull_events(store: ModelStore, source: str, name: str | None, access: LocalAccess, insecure: bool = False
                ) -> AsyncIterator[PullProgress | StoredModel | Exception]:
    """Yields PullProgress events, then the StoredModel, or the exception that stopped the pull."""
    return transfer_events(lambda put: store.pull(source, name, progress=put, access=access, insecure=insecure))


T = TypeVar("T")


async def transfer_events(job: Callable[[ProgressCallback], T]) -> AsyncIterator[PullProgress | T | Exception]:
    """Runs a pull or a push (``job(progress)``) in a thread of its own; yields its PullProgress events, then
    its result, or the exception that stopped it."""
    if not _claim():
        yield Busy(f"{MAX_PULLS + MAX_WAITING_PULLS} pulls are already running or waiting; try again later",
                   code="too_many_pulls")
        return
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def put(item: object) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop closed (daemon shutting down)
            pass

    def work() -> None:
        try:
            with _slots:
                result: object = job(put)
        except Exception as exc:  # every failure goes to the client as a message
            result = exc
        finally:
            _unclaim()
        put(result)

    # a daemon thread: a download stuck in a read never holds up the daemon's exit
    threading.Thread(target=work, name="pull", daemon=True).start()
    while True:
        item = await queue.get()
        yield item
        if not isinstance(item, PullProgress):
            break


def pull_error_status(exc: Exception) -> int:
    if isinstance(exc, RunnerError):
        return exc.status
    if isinstance(exc, NameConflictError):
        return 409
    if isinstance(exc, ModelNotFoundError):
        return 404
    return 400 if isinstance(exc, (InvalidNameError, SourceError, ValueError)) else 502


async def refused_before_streaming(events: AsyncIterator[T]) -> AsyncIterator[T]:
    """``events`` with its first item read already: a transfer that fails at once (an invalid name, a source this
    daemon does not read from, too many pulls) raises it as a RunnerError with its own status, so the client gets
    a 4xx before any stream starts, as Ollama answers; later failures stay in the stream."""
    it = aiter(events)
    try:
        first = await anext(it)
    except StopAsyncIteration:
        first = None
    if isinstance(first, RunnerError):
        raise first
    if isinstance(first, Exception):
        raise RunnerError(str(first), status=pull_error_status(first),
                          type="invalid_request_error" if pull_error_status(first) < 500 else "internal_error")

    async def chained() -> AsyncIterator[T]:
        if first is not None:
            yield first
        async for item in it:
            yield item
    return chained()


async def progress_response(body: dict, events: AsyncIterator) -> Response:
    """Ollama's answer to a pull, push or create: NDJSON progress lines, or one JSON object when ``stream`` is
    false."""
    if body.get("stream", True) is False:
        async for item in events:
            if isinstance(item, Exception):
                return JSONResponse({"error": str(item)}, status_code=pull_error_status(item))
        return JSONResponse({"status": "success"})

    events = await refused_before_streaming(events)

    async def lines() -> AsyncIterator[bytes]:
        async for item in events:
            if isinstance(item, PullProgress):
                yield ndjson_line(item.to_json())
            elif isinstance(item, Exception):
                yield ndjson_line({"error": str(item)})
    return StreamingResponse(lines(), media_type=NDJSON)
