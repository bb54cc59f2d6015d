"""Chat templates rendered off the event loop, so a slow one never stalls other requests or health checks.

Each render runs in a thread of its own, which hands the template to a worker process with a memory and CPU
limit (runlm/formats/template_process.py) and waits without the GIL; the worker is killed past its deadline.
As a second line, a thread still waiting past HARD_STOP_SECONDS gets an exception raised in it from here.
Threads still running are counted, and past MAX_RENDERS a request is turned away instead of adding another.
"""
from __future__ import annotations

import asyncio
import ctypes
import threading
from collections.abc import Callable
from typing import TypeVar

from runlm.formats.template_limits import RENDER_SECONDS, RenderLimitError
from runlm.server.errors import APIError

T = TypeVar("T")
HARD_STOP_SECONDS = RENDER_SECONDS + 1.0
MAX_RENDERS = 16
_live: set[threading.Thread] = set()


def _interrupt(thread: threading.Thread) -> None:
    if thread.ident is not None and thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(RenderLimitError))


async def render_off_loop(fn: Callable[[], T], timeout: float = HARD_STOP_SECONDS) -> T:
    """fn() in a new thread; its exception is raised here; past ``timeout`` it is stopped and
    RenderLimitError is raised."""
    if sum(t.is_alive() for t in list(_live)) >= MAX_RENDERS:  # (a copy: render threads remove themselves)
        raise APIError(503, "too many chat templates are rendering; retry shortly", code="server_busy")
    loop = asyncio.get_running_loop()
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
        except RuntimeError:  # the loop closed meanwhile
            pass
        finally:
            _live.discard(threading.current_thread())

    thread = threading.Thread(target=target, name="chat-template", daemon=True)
    _live.add(thread)
    thread.start()
    try:
        return await asyncio.wait_for(asyncio.shield(fut), timeout)
    except TimeoutError:
        _interrupt(thread)
        raise RenderLimitError("the chat template took too long to render") from None
