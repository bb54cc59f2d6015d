"""One HTTP request's engine requests: admitted against the queue bound, run together, merged into
one stream of (prompt index, RequestOutput), aborted together when the client goes away."""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from runlm.engine.async_llm import AsyncLLM, EngineDeadError
from runlm.engine.llm_engine import PromptError
from runlm.engine.request import RequestOutput
from runlm.engine.sampling_params import SamplingParams, SamplingParamsError
from runlm.server.errors import APIError, bad_request
from runlm.server.state import ServerState

_DONE = object()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(slots=True)
class Ticket:
    """Sequences this request holds in the server's bound on running + waiting work."""
    state: ServerState
    seqs: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.state.in_flight_seqs -= self.seqs


def admit(state: ServerState, engine: AsyncLLM, seqs: int) -> Ticket:
    """Take ``seqs`` places, or answer 503 with Retry-After when the waiting queue is full."""
    capacity = engine.engine.config.max_num_seqs + state.settings.max_waiting
    if seqs > capacity:
        raise bad_request(f"this request asks for {seqs} sequences (n x prompts), more than the server holds "
                          f"at once ({capacity})", "n")
    if state.in_flight_seqs + seqs > capacity:
        state.metrics.rejected.inc()
        raise APIError(503, f"the server is busy: {state.in_flight_seqs} sequences are running or waiting "
                            f"(limit {capacity}); retry shortly", code="queue_full", headers={"Retry-After": "1"})
    state.in_flight_seqs += seqs
    return Ticket(state, seqs)


class TicketedStreamingResponse(StreamingResponse):
    """Gives the ticket back however the response ends, even if its body never starts."""

    def __init__(self, content: Any, ticket: Ticket, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.ticket = ticket

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ticket.release()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@dataclass(slots=True)
class Generation:
    """The engine requests behind one HTTP request. Iterate ``stream()`` once."""
    state: ServerState
    engine: AsyncLLM
    http_request: Request
    prompts: list[list[int]]
    params: SamplingParams
    request_id: str
    priority: int = 0
    disconnected: bool = False
    arrival: float = field(default_factory=time.monotonic)

    async def stream(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue = asyncio.Queue()
        metrics = self.state.metrics

        async def pump(i: int, prompt: list[int]) -> None:
            timer = metrics.timer()
            try:
                async for out in self.engine.generate({"prompt_token_ids": prompt}, replace(self.params),
                                                      request_id=f"{self.request_id}-{i}", priority=self.priority):
                    timer.on_output(out)
                    queue.put_nowait((i, out))
            except asyncio.CancelledError:  # the client went away: the engine request is aborted
                timer.on_abort()
                raise
            except BaseException as exc:
                queue.put_nowait((i, exc))
            finally:
                queue.put_nowait((i, _DONE))

        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(self.prompts)]
        watcher = asyncio.create_task(_wait_for_disconnect(self.http_request))

        def on_disconnect(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is None:
                self.disconnected = True
                for task in tasks:  # cancelling a consumer aborts its engine request and frees its blocks
                    task.cancel()
        watcher.add_done_callback(on_disconnect)
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await queue.get()
                if item is _DONE:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise engine_error(item)
                else:
                    yield i, item
        finally:
            watcher.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def engine_error(exc: BaseException) -> APIError:
    """An engine exception as the error the client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, SamplingParamsError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, (PromptError, ValueError)):
        return bad_request(str(exc), "prompt")
    if isinstance(exc, EngineDeadError):
        return APIError(500, str(exc), code="engine_dead")
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", code="internal_error")
