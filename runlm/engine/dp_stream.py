"""DPRequestStream: one request's outputs through the data-parallel front end (runlm/engine/dp_client.py),
from whichever replica holds it. Until its first output it can move: if that replica dies, the request
is routed again (excluding the replicas it already tried); once output was streamed it fails instead.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from runlm.engine.async_llm import RequestStream
from runlm.engine.replica import ReplicaDeadError

if TYPE_CHECKING:
    from runlm.engine.dp_client import DPAsyncLLM

__all__ = ["DPRequestStream"]


class DPRequestStream(RequestStream):
    """A request's outputs from whichever replica holds it; if that replica dies before anything was
    streamed the request is sent to another, after that it fails with ReplicaDeadError."""

    def __init__(self, llm: DPAsyncLLM, request_id: str, request: tuple, pinned: int | None) -> None:
        self.llm, self.request_id, self.finished, self._closed = llm, request_id, False, False
        self.dp: DPAsyncLLM = llm
        self._request, self._pinned = request, pinned
        self._inner: Any = None
        self._tried: set[int] = set()
        self._streamed = False
        self.rank: int | None = None

    async def open(self) -> None:
        prompt, params, priority, output_kind, lora = self._request
        while True:
            replica = self.dp._route(prompt, self._pinned, self._tried)
            self.dp._owner[self.request_id] = replica.rank
            try:
                self._inner = await replica.add_request(self.request_id, prompt, params, priority=priority,
                                                        output_kind=output_kind, lora_request=lora)
            except ReplicaDeadError:
                self._tried.add(replica.rank)
                if self._pinned is not None:
                    self._forget()
                    raise
                continue
            except BaseException:
                self._forget()
                raise
            self.rank = replica.rank
            return

    async def __anext__(self) -> Any:
        if self.finished or self._closed:
            raise StopAsyncIteration
        while True:
            try:
                out = await self._inner.__anext__()
            except ReplicaDeadError as exc:
                if self._streamed or self._pinned is not None:
                    self.close()
                    raise ReplicaDeadError(f"{exc}; request {self.request_id} was lost after part of its "
                                           "output was streamed") from None
                self._tried.add(self.rank if self.rank is not None else -1)
                try:
                    await self.open()  # nothing was streamed: start it over on another replica
                except BaseException:
                    self.close()
                    raise
                continue
            except BaseException:
                self.close()
                raise
            self._streamed = True
            if out.finished:
                self.finished = True
                self.close()
            return out

    def _forget(self) -> None:
        self.dp._owner.pop(self.request_id, None)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._forget()
        inner = self._inner
        if inner is not None and not self.finished:
            close = getattr(inner, "close", None)
            if callable(close):
                close()
            else:  # an async generator: aclose it on the running loop
                try:
                    asyncio.get_running_loop().create_task(inner.aclose())
                except RuntimeError:
                    pass

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
