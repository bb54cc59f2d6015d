"""A data-parallel replica as a Ray actor on any node of a Ray cluster (``distributed_executor_backend="ray"``).

Ray does the cluster work, as it does for vLLM: a placement group reserves the replica's CPUs (its
``threads``) on one node, the actor (``replica_ray_actor.EngineActor``) is created in it and loads the
model there, resolved from the same store name; Ray notices a dead actor process and restarts it
(``max_restarts``), re-running its constructor; outputs stream back through Ray's streaming generators
(``num_returns="streaming"``). On top of that a health check asks the actor whether its engine thread
is alive and, when not, kills the actor so that Ray restarts it.

What the front end sees: the engine's typed errors come back as themselves; a request whose actor dies
fails with ReplicaDeadError (the front end may retry it elsewhere when nothing was streamed); new
requests sent while Ray restarts the actor wait for it (up to ``restart_wait_s``; the replica reports them
as waiting, so a load-balancing front end sends others elsewhere meanwhile). ``alive`` turns False once Ray has given up
(restarts spent) or after ``shutdown``.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from runlm.engine.engine_core import EngineStats
from runlm.engine.parallel.ray_actor import ACCEPTED, EngineActor
from runlm.engine.parallel.replica import EngineReplica, RemoteError, ReplicaDeadError, ReplicaLoad, ReplicaSpec
from runlm.engine.types.lora_request import LoRARequest
from runlm.engine.types.outputs import PoolingRequestOutput, RequestOutput
from runlm.engine.types.pooling_params import PoolingParams
from runlm.engine.types.sampling_params import SamplingParams

__all__ = ["RayReplica", "ReplicaRestartingError"]

T = TypeVar("T")
log = logging.getLogger("runlm.engine.ray")
_init_lock = threading.Lock()


class ReplicaRestartingError(ReplicaDeadError):
    """The actor died and Ray is restarting it: requests it held are lost, new ones can wait for it."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RuntimeError("the Ray backend needs Ray: pip install 'runlm[ray]'") from None
    return ray


def connect(address: str = "auto") -> Any:
    """Join the Ray cluster at ``address`` once per process (``auto``: the one `ray start` runs here)."""
    ray = import_ray()
    with _init_lock:
        if not ray.is_initialized():
            ray.init(address=address, logging_level=logging.WARNING, configure_logging=False)
    return ray


class RayReplica(EngineReplica):
    max_restarts = 4              # Ray restarts a dead actor this many times, then the replica is dead
    placement_timeout_s = 300.0   # how long to wait for a node with the replica's CPUs free
    health_check_period_s = 2.0   # how often the actor's engine is checked (and its counters read)
    health_check_timeout_s = 60.0
    restart_wait_s = 300.0        # how long a new request or call waits for an actor that Ray restarts

    def __init__(self, spec: ReplicaSpec, ray_address: str = "auto") -> None:
        self.spec, self.ray_address = spec, ray_address
        self.num_cpus = int(spec.engine_args.get("threads") or 1)
        self.where: dict[str, Any] = {}  # node_id and pid of the actor, as last seen
        self.info: dict[str, Any] = {}   # tokenizer, max_model_len, ... (AsyncLLM.replica_info) once started
        self.last_stats: EngineStats | None = None  # the engine's counters at the last heartbeat
        self._actor: Any = None
        self._pg: Any = None
        self._streams: dict[str, _RayStream] = {}
        self._dead = self._closed = False
        self._waiting = 0  # requests and calls waiting for a restarting actor
        self._suspect = threading.Event()  # an actor error was seen: the watcher asks Ray at once

    # ---- life --------------------------------------------------------------------------------------
    async def start(self) -> None:
        ray = connect(self.ray_address)  # blocks only the first time in a process
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._pg = placement_group([{"CPU": self.num_cpus}], strategy="STRICT_PACK")
        try:
            await asyncio.wait_for(self._pg.ready(), self.placement_timeout_s)
        except TimeoutError:
            ray.util.remove_placement_group(self._pg)
            raise ReplicaDeadError(f"replica {self.rank}: no Ray node had {self.num_cpus} CPU(s) free within "
                                   f"{self.placement_timeout_s:.0f} s") from None
        actor_cls = ray.remote(EngineActor).options(
            num_cpus=self.num_cpus, max_restarts=self.max_restarts, max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self._pg,
                                                                 placement_group_bundle_index=0))
        self._actor = actor_cls.remote(self.spec.model, self.spec.engine_args)
        try:
            self.where = await self._actor.where.remote()  # answers once the constructor loaded the model
        except ray.exceptions.RayError as exc:
            await self.shutdown()
            raise ReplicaDeadError(f"replica {self.rank} failed to start on Ray: {_reason(exc)}") from None
        if self.where["load_error"] is not None:  # the engine's own error (UnknownModelError...), as itself
            await self.shutdown()
            raise self.where["load_error"].rebuild()
        self.info = self.where["info"]
        log.info("replica %d is a Ray actor on node %s (pid %s)", self.rank, self.where["node_id"], self.where["pid"])
        threading.Thread(target=self._watch, name=f"runlm-ray-watch{self.rank}", daemon=True).start()

    @property
    def actor(self) -> Any:
        """The Ray actor handle (for Ray's own tools: ray.kill, the state API)."""
        return self._actor

    async def locate(self) -> dict[str, Any]:
        """Ask the actor where it runs now (a restarted actor may have moved); updates ``where``."""
        self.where = await self._when_available(lambda: self._remote(self._actor.where.remote()))
        return self.where

    @property
    def alive(self) -> bool:
        return self._actor is not None and not (self._dead or self._closed)

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._suspect.set()  # wakes the watcher, which sees _closed and ends
        ray = import_ray()
        if self._actor is not None:
            ray.kill(self._actor, no_restart=True)  # its open streams end with RayActorError -> ReplicaDeadError
        if self._pg is not None:
            ray.util.remove_placement_group(self._pg)

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(waiting=self._waiting, running=len(self._streams))

    # ---- requests ------------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: Any,
                          params: SamplingParams | PoolingParams | None, *, priority: int = 0,
                          output_kind: str = "delta",
                          lora_request: LoRARequest | None = None
                          ) -> AsyncIterator[RequestOutput | PoolingRequestOutput]:
        async def accepted() -> _RayStream:
            gen = self._actor.generate.options(num_returns="streaming").remote(
                request_id, prompt, params, priority, output_kind, lora_request)
            stream = _RayStream(self, request_id, gen)
            first = await stream.pull()  # ACCEPTED, or the engine's up-front error raised here
            if first != ACCEPTED:
                raise ReplicaDeadError(f"replica {self.rank} answered {first!r} to a new request")
            return stream

        stream = await self._when_available(accepted)
        self._streams[request_id] = stream
        return stream

    async def abort(self, request_ids: list[str]) -> None:
        if self.alive:
            try:
                await self._remote(self._actor.abort.remote(list(request_ids)))
            except ReplicaRestartingError:
                pass  # a restarted actor holds none of them

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        result = await self._when_available(lambda: self._remote(self._actor.call.remote(method, args, kwargs)))
        if isinstance(result, RemoteError):
            raise result.rebuild()
        return result

    async def _when_available(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """Run attempt, again while Ray restarts the actor (nothing of it ran there: the restarted actor is new)."""
        self._check_usable()
        deadline = time.monotonic() + self.restart_wait_s
        self._waiting += 1
        try:
            while True:
                try:
                    return await attempt()
                except ReplicaRestartingError:
                    if not self.alive or time.monotonic() > deadline:
                        raise
                await asyncio.sleep(0.25)
        finally:
            self._waiting -= 1

    # ---- Ray's errors -> ours ---------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._actor is None:
            raise ReplicaDeadError(f"replica {self.rank} was not started")
        if self._closed or self._dead:
            raise ReplicaDeadError(f"replica {self.rank} is {'shut down' if self._closed else 'dead'}")

    async def _remote(self, ref: Any) -> Any:
        ray = import_ray()
        try:
            return await ref
        except ray.exceptions.RayError as exc:
            raise self.died(exc) from None

    def died(self, exc: BaseException) -> ReplicaDeadError:
        """The error for a request the actor failed; after an ActorDiedError the watcher asks Ray whether the
        actor comes back (else the replica is dead)."""
        ray = import_ray()
        if isinstance(exc, ray.exceptions.ActorUnavailableError) and not self._closed:
            return ReplicaRestartingError(f"replica {self.rank} (Ray actor) is restarting: {_reason(exc)}")
        if isinstance(exc, ray.exceptions.ActorDiedError):
            self._suspect.set()  # the watcher finds out whether Ray restarts it
        return ReplicaDeadError(f"replica {self.rank} (Ray actor) failed: {_reason(exc)}")

    def _watch(self) -> None:
        """The replica's watcher thread (not tied to the event loop that started the replica). Ray restarts a
        dead actor process by itself; a live actor whose engine thread died is killed here so that Ray
        restarts it too; after an actor death it asks Ray whether the actor comes back."""
        ray = import_ray()
        while not self._closed and not self._dead:
            suspect = self._suspect.wait(self.health_check_period_s)
            self._suspect.clear()
            if self._closed:
                return
            try:
                if suspect:  # a call on a restarting actor fails at once ("unavailable"); on a dead one, "died"
                    self.where = ray.get(self._actor.where.remote(), timeout=self.health_check_timeout_s)
                else:
                    beat = ray.get(self._actor.heartbeat.remote(), timeout=self.health_check_timeout_s)
                    if isinstance(beat, RemoteError):
                        raise beat.rebuild()
                    self.last_stats = beat
            except ray.exceptions.ActorDiedError:
                if not self._closed:
                    self._dead = True
                    log.error("replica %d: its Ray actor died and Ray will not restart it", self.rank)
            except ray.exceptions.ActorUnavailableError:
                self._suspect.set()  # restarting: ask again
                time.sleep(0.5)
            except Exception as exc:  # a dead engine thread, or no answer in time (GetTimeoutError)
                if not self._closed:
                    log.error("replica %d failed its health check (%s); Ray restarts its actor", self.rank,
                              _reason(exc))
                    ray.kill(self._actor, no_restart=False)


def _reason(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class _RayStream:
    """A request's outputs from the actor's streaming generator; closing it early aborts the request."""

    def __init__(self, replica: RayReplica, request_id: str, gen: Any) -> None:
        self.replica, self.request_id, self._gen = replica, request_id, gen
        self.done = False

    def __aiter__(self) -> _RayStream:
        return self

    async def pull(self) -> Any:
        ray = import_ray()
        try:
            item = await (await self._gen.__anext__())
        except StopAsyncIteration:
            self._finish()
            raise
        except ray.exceptions.RayError as exc:
            self._finish()
            raise self.replica.died(exc) from None
        except BaseException:  # cancelled: the consumer has gone
            await self.aclose()
            raise
        if isinstance(item, RemoteError):
            self._finish()
            raise item.rebuild()
        return item

    async def __anext__(self) -> RequestOutput | PoolingRequestOutput:
        if self.done:
            raise StopAsyncIteration
        out = await self.pull()
        if getattr(out, "finished", False):
            self._finish()
        return out

    def _finish(self) -> None:
        self.done = True
        self.replica._streams.pop(self.request_id, None)

    async def aclose(self) -> None:
        if not self.done:
            self._finish()
            if self.replica.alive:
                self.replica._actor.abort.remote([self.request_id])  # fire and forget: the stream ends 'abort'
