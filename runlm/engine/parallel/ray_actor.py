"""What a Ray actor replica runs: an ``AsyncLLM`` in an async actor (vLLM's DP engine core on a Ray node).

This module does not import Ray: ``runlm/engine/parallel/ray_replica.py`` makes the class below a Ray actor
(``ray.remote(EngineActor)``), so the logic here is plain Python. The model is resolved on the node
the actor lands on, from the same store name the front end was given (``AsyncLLM(name)`` goes
through the store's normal resolution), so every node needs the model in its own store.

Errors cross the boundary in a ``RemoteError`` envelope rather than as pickled exceptions: an
exception whose ``__init__`` takes other arguments than its ``args`` (SamplingParamsError,
PromptTooLongError) cannot be unpickled the ordinary way, and Ray would hand back an
``UnserializableException`` instead of the engine's typed error.
"""
from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

from runlm.engine.parallel.replica import RemoteError, call_method
from runlm.engine.types.lora_request import LoRARequest
from runlm.engine.types.pooling_params import PoolingParams
from runlm.engine.types.sampling_params import SamplingParams

__all__ = ["ACCEPTED", "EngineActor"]

ACCEPTED = "accepted"  # the first item of a request's stream: the engine took it (its checks passed)


class EngineActor:
    """One replica's engine, hosted by a Ray actor. Every method is async (Ray runs them on the actor's
    event loop, so many requests stream at once); the engine computes on AsyncLLM's own thread."""

    def __init__(self, model: str, engine_args: dict[str, Any]) -> None:
        from runlm.engine.async_inproc import AsyncLLM

        # a model that does not load is kept as an answer rather than raised: Ray would report only that
        # the constructor failed, and the front end should get the engine's own error (UnknownModelError...)
        self.load_error: RemoteError | None = None
        try:
            self.llm = AsyncLLM(model, **engine_args)
        except Exception as exc:
            self.load_error = RemoteError.of(exc)

    async def where(self) -> dict[str, Any]:
        """Where this actor runs (its Ray node and process), whether its model failed to load, and what a
        front end needs to stand in for the engine (``AsyncLLM.replica_info`` where it has one)."""
        import ray

        info_of = getattr(self.llm, "replica_info", None) if self.load_error is None else None
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "load_error": self.load_error, "info": info_of() if info_of else {}}

    async def heartbeat(self) -> Any:
        """The engine's EngineStats, or (a RemoteError) why this actor cannot serve: its model did not
        load, or its engine thread died."""
        if self.load_error is not None:
            return self.load_error
        try:
            self.llm.check_health_now()
        except Exception as exc:
            return RemoteError.of(exc)
        return self.llm.stats()

    async def generate(self, request_id: str, prompt: Any, params: SamplingParams | PoolingParams | None,
                       priority: int, output_kind: str, lora_request: LoRARequest | None
                       ) -> AsyncIterator[Any]:
        """A request's stream (a Ray streaming generator): ``ACCEPTED`` or a RemoteError first (the engine's
        up-front checks), then its outputs; a failure mid-stream ends it with a RemoteError. The request is
        aborted when the caller cancels the stream or the actor method is torn down."""
        if self.load_error is not None:
            yield self.load_error
            return
        try:
            stream = await self.llm.add_request(request_id, prompt, params, priority, output_kind, lora_request)
        except Exception as exc:
            yield RemoteError.of(exc)
            return
        try:
            yield ACCEPTED
            async for out in stream:
                yield out
        except Exception as exc:
            yield RemoteError.of(exc)
        finally:
            stream.close()

    async def abort(self, request_ids: list[str]) -> None:
        if self.load_error is None:
            await self.llm.abort(request_ids)

    async def call(self, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Run an AsyncLLM method by name (runlm/engine/parallel/replica.py's CALLABLE); its result, or a
        RemoteError for what it raised."""
        if self.load_error is not None:
            return self.load_error
        try:
            return await call_method(self.llm, method, args, kwargs)
        except Exception as exc:
            return RemoteError.of(exc)

    async def shutdown(self) -> None:
        if self.load_error is None:
            self.llm.shutdown()
