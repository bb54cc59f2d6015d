"""Pulls run in a worker thread; their progress comes back to the event loop as a stream of events."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from runlm.store import InvalidNameError, ModelStore, StoredModel
from runlm.store.progress import PullProgress
from runlm.store.sources import LocalAccess, SourceError


async def pull_events(store: ModelStore, source: str, name: str | None, access: LocalAccess
                      ) -> AsyncIterator[PullProgress | StoredModel | Exception]:
    """Yields PullProgress events, then the StoredModel, or the exception that stopped the pull."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def report(p: PullProgress) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, p)

    def work() -> None:
        try:
            result: object = store.pull(source, name, progress=report, access=access)
        except Exception as exc:  # every failure goes to the client as a message
            result = exc
        loop.call_soon_threadsafe(queue.put_nowait, result)

    worker = loop.run_in_executor(None, work)
    while True:
        item = await queue.get()
        yield item
        if not isinstance(item, PullProgress):
            break
    await worker


def pull_error_status(exc: Exception) -> int:
    return 400 if isinstance(exc, (InvalidNameError, SourceError, ValueError)) else 502
