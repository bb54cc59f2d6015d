"""One data-parallel engine replica, wherever it runs (vLLM's DP engine cores).

A front end with ``data_parallel_size=N`` holds N replicas and routes each request to one of them.
A replica hosts a whole ``AsyncLLM`` (its engine core and engine thread) somewhere else: a child
process on this machine (``distributed_executor_backend="mp"``) or a Ray actor on any node of a Ray
cluster (``"ray"``). Both kinds implement this interface, so the front end's routing, draining,
restarting and fan-out (sleep, pause, profile, ``collective_rpc``) are written once.

Everything crossing the boundary is picklable: prompts, SamplingParams/PoolingParams, LoRARequest,
RequestOutput/PoolingRequestOutput, EngineStats, and errors, which travel in one envelope (``RemoteError``)
for both kinds, so the engine's typed errors (runlm/engine/types/errors.py) are raised on the front end's
side as themselves. Both kinds run the same methods by name: ``CALLABLE``, through ``call_method``.
"""
from __future__ import annotations

import inspect
import pickle
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from runlm.engine.types.lora_request import LoRARequest
from runlm.engine.types.outputs import PoolingRequestOutput, RequestOutput
from runlm.engine.types.pooling_params import PoolingParams
from runlm.engine.types.sampling_params import SamplingParams

__all__ = ["CALLABLE", "EngineReplica", "RemoteError", "ReplicaDeadError", "ReplicaLoad", "ReplicaSpec",
           "call_method"]

# the AsyncLLM methods a front end may run in a replica by name (requests have their own path)
CALLABLE = frozenset({"sleep", "wake_up", "pause_generation", "resume_generation", "is_paused", "is_sleeping",
                      "reset_prefix_cache", "reset_mm_cache", "add_lora", "remove_lora", "list_loras", "pin_lora",
                      "start_profile", "stop_profile", "wait_for_requests_to_drain", "stats", "collective_rpc",
                      "check_health", "get_supported_tasks", "replica_info", "set_num_threads"})


async def call_method(llm: Any, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
    """Run ``llm.method(*args, **kwargs)`` in a replica (awaited where it is a coroutine), if CALLABLE has it."""
    if method not in CALLABLE:
        raise ValueError(f"a replica runs the public AsyncLLM methods a front end needs, not {method!r}")
    result = getattr(llm, method)(*args, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result


@dataclass(frozen=True)
class RemoteError:
    """An exception as data, the one way errors cross from a replica to its front end: its class (pickled by
    reference), its ``args`` and its attributes. Rebuilt without calling ``__init__``, so any exception class
    comes back as itself with its fields."""
    cls: type[BaseException]
    args: tuple
    state: dict[str, Any]

    @classmethod
    def of(cls, exc: BaseException) -> RemoteError:
        state = {k: v for k, v in vars(exc).items() if not k.startswith("__")}
        try:
            pickle.dumps((type(exc), exc.args, state))
        except Exception:  # a field that cannot travel: keep the type and the message
            return cls(type(exc) if _picklable(type(exc)) else RuntimeError, (str(exc),), {})
        return cls(type(exc), exc.args, state)

    def rebuild(self) -> BaseException:
        exc = self.cls.__new__(self.cls)
        exc.args = self.args
        exc.__dict__.update(self.state)
        return exc


def _picklable(obj: Any) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True


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
        """Run a named ``AsyncLLM`` method (one of ``CALLABLE``) in the replica and return its (picklable)
        result, or raise what it raised."""

    @abstractmethod
    def load(self) -> ReplicaLoad:
        """The replica's current load, answered without a round trip."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop the replica and free its process/actor; its open streams end with ReplicaDeadError."""
