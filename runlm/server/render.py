"""Chat templates rendered off the event loop, so a slow one never stalls other requests or health checks.

Each render runs in a thread of its own, which hands the template to a worker process with a memory and CPU
limit (runlm/formats/template_process.py) and waits without the GIL; the worker is killed past its deadline.
As a second line, a thread still waiting past HARD_STOP_SECONDS gets an exception raised in it from here.
At most MAX_RENDERS threads run at once (a thread still running holds its place until it ends); a request
past that waits for a place, and is turned away with a 503 only when none frees within HARD_STOP_SECONDS.
"""
from __future__ import annotations

import asyncio
import ctypes
import threading
import weakref
from collections.abc import Callable
from typing import TypeVar

from runlm.formats.template_limits import RENDER_SECONDS, RenderLimitError
from runlm.server.errors import APIError

T = TypeVar("T")
HARD_STOP_SECONDS = RENDER_SECONDS + 1.0
MAX_RENDERS = 16
# the places of each event loop (a server has one; tests start several)
_places: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def _interrupt(thread: threading.Thread) -> None:
    if thread.ident is not None and thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(RenderLimitError))


async def render_off_loop(fn: Callable[[], T], timeout: float = HARD_STOP_SECONDS) -> T:
    """fn() in a new thread; its exception is raised here; past ``timeout`` it is stopped and
    RenderLimitError is raised."""
    loop = asyncio.get_running_loop()
    places = _places.setdefault(loop, asyncio.Semaphore(MAX_RENDERS))
    try:
        await asyncio.wait_for(places.acquire(), timeout)
    except TimeoutError:
        raise APIError(503, "too many chat templates are rendering; retry shortly", code="server_busy") from None
    fut: asyncio.Future[T] = loop.create_future()

    def deliver(result: object, exc: BaseException | None) -> None:
        if not fut.done():
            fut.set_exception(exc) if exc is not None else fut.set_result(result)  # type: ignore[arg-type]

    def target() -> None:
        try:
            result, exc = fn(), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting request
            result, exc = None, e
        try:
            loop.call_soon_threadsafe(deliver, result, exc)
            loop.call_soon_threadsafe(places.release)  # this thread's place, once it has ended
        except RuntimeError:  # the loop closed meanwhile
            pass

    thread = threading.Thread(target=target, name="chat-template", daemon=True)
    thread.start()
    try:
        return await asyncio.wait_for(asyncio.shield(fut), timeout)
    except TimeoutError:
        _interrupt(thread)
        raise RenderLimitError("the chat template took too long to render") from None
