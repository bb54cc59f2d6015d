"""One data-parallel engine replica, wherever it runs (vLLM's DP engine cores).

A front end with ``data_parallel_size=N`` holds N replicas and routes each request to one of them.
A replica hosts a whole ``AsyncLLM`` (its engine core and engine thread) somewhere else: a child
process on this machine (``distributed_executor_backend="mp"``) or a Ray actor on any node of a Ray
cluster (``"ray"``). Both kinds implement this interface, so the front end's routing, draining,
restarting and fan-out (sleep, pause, profile, ``collective_rpc``) are written once.

Everything crossing the boundary is picklable: prompts, SamplingParams/PoolingParams, LoRARequest,
RequestOutput/PoolingRequestOutput, EngineStats, and the engine's typed errors (runlm/engine/types/errors.py),
which a replica re-raises on the front end's side unchanged.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from runlm.engine.types.lora_request import LoRARequest
from runlm.engine.types.outputs import PoolingRequestOutput, RequestOutput
from runlm.engine.types.pooling_params import PoolingParams
from runlm.engine.types.sampling_params import SamplingParams

__all__ = ["EngineReplica", "ReplicaDeadError", "ReplicaLoad", "ReplicaSpec"]


class ReplicaDeadError(RuntimeError):
    """The replica's process or actor is gone; the requests it held fail with this (or are retried on
    another replica when nothing of theirs was streamed yet)."""


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica needs to build its engine: the model as the store names it (each node resolves it
    in its own store) and the engine arguments, with ``num_threads`` already this replica's share."""
    model: str
    engine_args: dict[str, Any]
    rank: int


@dataclass
class ReplicaLoad:
    """The replica's queue as the router sees it (its front-end count of in-flight requests, refreshed
    from EngineStats when it has them)."""
    waiting: int = 0
    running: int = 0

    @property
    def total(self) -> int:
        return self.waiting + self.running


class EngineReplica(ABC):
    """One engine core behind a data-parallel front end."""

    spec: ReplicaSpec

    @property
    def rank(self) -> int:
        return self.spec.rank

    @abstractmethod
    async def start(self) -> None:
        """Create the process/actor and load the model; return once it can take requests."""

    @property
    @abstractmethod
    def alive(self) -> bool:
        """False once the process/actor has died or been shut down."""

    @abstractmethod
    async def add_request(self, request_id: str, prompt: Any,
                          params: SamplingParams | PoolingParams | None, *, priority: int = 0,
                          output_kind: str = "delta",
                          lora_request: LoRARequest | None = None
                          ) -> AsyncIterator[RequestOutput | PoolingRequestOutput]:
        """Queue a request (the engine's up-front checks run and raise here, before any output) and
        return its outputs' async iterator. Closing the iterator early aborts the request."""

    @abstractmethod
    async def abort(self, request_ids: list[str]) -> None:
        """Abort requests on this replica (unknown ids are ignored)."""

    @abstractmethod
    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run a named ``AsyncLLM`` method in the replica and return its (picklable) result: sleep,
        wake_up, pause_generation, resume_generation, reset_prefix_cache, add_lora, start_profile,
        stop_profile, wait_for_requests_to_drain, stats, and ``collective_rpc``'s engine methods."""

    @abstractmethod
    def load(self) -> ReplicaLoad:
        """The replica's current load, answered without a round trip."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop the replica and free its process/actor; its open streams end with ReplicaDeadError."""
