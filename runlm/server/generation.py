"""One HTTP request's engine requests: admitted against the queue bound, added to the engine (whose
typed errors become HTTP errors here, before any header is sent), run together, merged into one stream
of (prompt index, RequestOutput), aborted together when the client goes away."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from runlm.engine.async_inproc import AsyncLLM, RequestStream
from runlm.engine.parallel.client import DPAsyncLLM
from runlm.engine.parallel.replica import ReplicaDeadError
from runlm.engine.types.errors import (
    EngineDeadError,
    LoRAError,
    PromptError,
    PromptTooLongError,
    SamplingParamsError,
    StepOutOfMemoryError,
    TaskError,
)
from runlm.engine.types.lora_request import LoRARequest
from runlm.engine.types.outputs import RequestOutput
from runlm.engine.types.sampling_params import SamplingParams
from runlm.engine.types.structured_params import StructuredOutputsError
from runlm.server.context_shift import ShiftingStream, can_shift
from runlm.server.errors import APIError, bad_request
from runlm.server.media import CheckedImage
from runlm.server.state import ServerState
from runlm.server.structured import structured_error
from runlm.web.disconnect import wait_for_disconnect

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
    capacity = engine.max_num_seqs + state.settings.max_waiting
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
    """Gives the ticket back, and aborts what has not finished, however the response ends, even if its
    body never starts."""

    def __init__(self, content: Any, ticket: Ticket, generation: Generation, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.ticket, self.generation = ticket, generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()
            self.ticket.release()


async def start_generation(state: ServerState, engine: AsyncLLM, http_request: Request, prompts: list[list[int]],
                           params: SamplingParams, request_id: str, priority: int, prompt_param: str,
                           constraint_source: str | None, lora_request: LoRARequest | None = None,
                           images: list[CheckedImage] | None = None, shift: int | None = None
                           ) -> tuple[Generation, Ticket]:
    """Admit the request, then add it to the engine; on a refusal the places are given back. ``images``: a chat
    prompt's images (checked already), in the order of its placeholders. ``shift``: the n_keep of a generation
    that shifts its context when it fills (None: it stops there)."""
    ticket = admit(state, engine, params.n * len(prompts))
    gen = Generation(state, engine, http_request, prompts, params, request_id, priority, prompt_param,
                     constraint_source, lora_request, images=images or [], shift=shift)
    try:
        await gen.start()
    except BaseException:
        ticket.release()
        raise
    return gen, ticket


@dataclass(slots=True)
class Generation:
    """The engine requests behind one HTTP request: ``await start()`` (raises APIError before any
    output), then iterate ``stream()`` once; ``close()`` aborts whatever has not finished."""
    state: ServerState
    engine: AsyncLLM
    http_request: Request
    prompts: list[list[int]]
    params: SamplingParams
    request_id: str
    priority: int = 0
    prompt_param: str = "prompt"              # the request field that holds the prompt, for errors
    constraint_source: str | None = None      # the request field a structured-output constraint came from
    lora_request: LoRARequest | None = None   # the adapter the request's model names
    images: list[CheckedImage] = field(default_factory=list)  # a chat prompt's images, for multi_modal_data
    shift: int | None = None                  # n_keep, for a generation that shifts its context when it fills
    disconnected: bool = False
    arrival: float = field(default_factory=time.monotonic)
    streams: list[RequestStream | ShiftingStream] = field(default_factory=list)

    async def start(self) -> None:
        """Add every prompt to the engine, which checks it; the first refusal aborts the rest."""
        pin = data_parallel_rank(self.http_request, self.engine)

        async def add(rid: str, ids: list[int], params: SamplingParams) -> RequestStream:  # a shift's next request
            return await self.engine.add_request(rid, {"prompt_token_ids": ids}, params, self.priority,
                                                 lora_request=self.lora_request, data_parallel_rank=pin)
        try:
            for i, prompt in enumerate(self.prompts):
                inputs: dict[str, Any] = {"prompt_token_ids": prompt}
                if self.images:  # decoded for an engine in this process; replicas elsewhere get the bytes
                    remote = isinstance(self.engine, DPAsyncLLM)
                    inputs["multi_modal_data"] = {"image": [i.data if remote else i.image for i in self.images]}
                rid = f"{self.request_id}-{i}"
                stream: RequestStream | ShiftingStream = await self.engine.add_request(
                    rid, inputs, replace(self.params), self.priority, lora_request=self.lora_request,
                    data_parallel_rank=pin)
                if self.shift is not None and not self.images and can_shift(self.params):
                    stream = ShiftingStream(add, stream, rid, prompt, self.params, self.shift,
                                            self.engine.tokenizer.bos_token_id)
                self.streams.append(stream)
        except BaseException as exc:
            self.close()
            if isinstance(exc, Exception):
                raise engine_error(exc, self.prompt_param, self.constraint_source) from None
            raise

    def close(self) -> None:
        for stream in self.streams:
            stream.close()

    async def stream(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue = asyncio.Queue()
        metrics = self.state.metrics

        async def pump(i: int, stream: RequestStream | ShiftingStream) -> None:
            timer = metrics.timer()
            try:
                async for out in stream:
                    timer.on_output(out)
                    queue.put_nowait((i, out))
            except asyncio.CancelledError:  # the client went away: the engine request is aborted
                timer.on_abort()
                raise
            except BaseException as exc:
                queue.put_nowait((i, exc))
            finally:
                stream.close()
                queue.put_nowait((i, _DONE))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        watcher = asyncio.create_task(wait_for_disconnect(self.http_request))

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
                    raise engine_error(item, self.prompt_param, self.constraint_source)
                else:
                    yield i, item
        finally:
            watcher.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.close()


def data_parallel_rank(http_request: Request, engine: AsyncLLM) -> int | None:
    """vLLM's ``X-data-parallel-rank`` header: pin the request to that replica of a data-parallel
    engine (an in-process engine is rank 0)."""
    value = http_request.headers.get("x-data-parallel-rank")
    if value is None:
        return None
    replicas = getattr(engine, "replicas", {0: None})
    if not value.strip().isdigit() or int(value) not in replicas:
        raise APIError(400, f"X-data-parallel-rank must name a replica ({sorted(replicas)}), not {value!r}",
                       param="X-data-parallel-rank", code="invalid_data_parallel_rank")
    return int(value)


def engine_error(exc: BaseException, prompt_param: str = "prompt", constraint_source: str | None = None) -> APIError:
    """An engine exception as the error the client should see: the engine's typed errors are 400s
    naming the request field; anything else is the server's fault."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, StructuredOutputsError) and constraint_source is not None:
        return structured_error(exc, constraint_source)
    if isinstance(exc, SamplingParamsError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, TaskError):
        return APIError(400, str(exc), param="model", code="unsupported_task")
    if isinstance(exc, LoRAError):
        return bad_request(str(exc), "model", "invalid_lora_adapter")
    if isinstance(exc, PromptTooLongError):
        return bad_request(str(exc), prompt_param, "context_length_exceeded")
    if isinstance(exc, (PromptError, ValueError)):
        return bad_request(str(exc), prompt_param)
    if isinstance(exc, EngineDeadError):
        return APIError(500, str(exc), code="engine_dead")
    if isinstance(exc, StepOutOfMemoryError):  # (dropped by a step that ran out of memory; the engine serves on)
        return APIError(503, str(exc), code="out_of_memory", headers={"Retry-After": "1"})
    if isinstance(exc, ReplicaDeadError):  # one data-parallel replica died (it is being restarted)
        return APIError(503, str(exc), code="replica_dead", headers={"Retry-After": "1"})
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", code="internal_error")
