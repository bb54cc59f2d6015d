"""The data-parallel front end's replicas: starting them, restarting the ones that die, and elastic
scaling (grow: a new replica serves once loaded; shrink: drained first, then stopped).

Replicas are started, restarted and stopped on short-lived threads with their own event loop, so the
front end's constructor (synchronous, like AsyncLLM's) and a restart noticed by the watcher thread
need no running loop; a replica is not tied to the loop that started it (see replica.py).
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from runlm.engine.parallel.replica import EngineReplica, ReplicaSpec

__all__ = ["BACKENDS", "ReplicaPool", "replica_devices", "replica_factory", "run_in_thread"]

log = logging.getLogger("runlm.engine.dp")
T = TypeVar("T")
BACKENDS = ("mp", "ray")
_WATCH_PERIOD = 0.5          # seconds between liveness checks
_RESTART_BACKOFF = (1.0, 2.0, 5.0, 10.0, 30.0)


def replica_factory(backend: str, **options: Any) -> Callable[[ReplicaSpec], EngineReplica]:
    """``distributed_executor_backend`` -> how to build one replica: "mp" a child process on this
    machine, "ray" an actor on a Ray cluster (``ray_address``; imported only when asked for)."""
    if backend == "mp":
        from runlm.engine.parallel.process import ProcessReplica
        return ProcessReplica
    if backend == "ray":
        from runlm.engine.parallel.ray_replica import RayReplica
        return lambda spec: RayReplica(spec, **options)
    raise ValueError(f"distributed_executor_backend must be one of {', '.join(BACKENDS)}, not {backend!r}")


def run_in_thread(fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to the end on a fresh thread and event loop; block until it is done."""
    box: list[Any] = []

    def target() -> None:
        try:
            box.append((True, asyncio.run(fn())))
        except BaseException as exc:
            box.append((False, exc))
    thread = threading.Thread(target=target, name="runlm-dp-start", daemon=True)
    thread.start()
    thread.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value


def replica_devices(device: str | None, backend: str, gpus: int) -> list[str] | None:
    """One GPU a replica (vLLM's placement): on this machine ("mp") with a bare ``cuda`` and several GPUs, replica
    r runs on cuda:(r % gpus); None (the device as given) for one GPU, a named one (cuda:1), the CPU, or Ray (whose
    actors are given GPUs of their own)."""
    if backend != "mp" or device != "cuda" or gpus < 2:
        return None
    return [f"cuda:{i}" for i in range(gpus)]


class ReplicaPool:
    def __init__(self, model: str, engine_args: dict[str, Any], total_threads: int,
                 make: Callable[[ReplicaSpec], EngineReplica],
                 prepare: Callable[[EngineReplica], Awaitable[None]],
                 on_gone: Callable[[int], None], devices: list[str] | None = None) -> None:
        """``prepare`` brings a new replica to the front end's state (adapters, sleep, pause) before it
        serves; ``on_gone(rank)`` is told when a replica's cache is lost (restart, removal); ``devices``: replica
        r's device is devices[r % len(devices)] (replica_devices), else the engine arguments' own."""
        self.model, self.engine_args, self.total_threads, self.devices = model, engine_args, total_threads, devices
        self.make, self.prepare, self.on_gone = make, prepare, on_gone
        self.replicas: dict[int, EngineReplica] = {}
        self.draining: set[int] = set()
        self.restarting: set[int] = set()
        self.restarts = 0
        self.closed = False
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    def spec(self, rank: int, size: int) -> ReplicaSpec:
        threads = max(1, self.total_threads // max(1, size))
        args = dict(self.engine_args, threads=threads)
        if self.devices:
            args["device"] = self.devices[rank % len(self.devices)]
            if size > len(self.devices):
                log.warning("%d replicas on %d GPUs: replica %d shares %s", size, len(self.devices), rank,
                            args["device"])
        return ReplicaSpec(self.model, args, rank)

    # ---- start and stop ------------------------------------------------------------------------
    def start(self, size: int) -> None:
        new = [self.make(self.spec(rank, size)) for rank in range(size)]
        run_in_thread(lambda: self._start_all(new))
        self.replicas.update((r.rank, r) for r in new)
        self._watcher = threading.Thread(target=self._watch, name="runlm-dp-watch", daemon=True)
        self._watcher.start()

    async def _start_all(self, replicas: list[EngineReplica]) -> None:
        results = await asyncio.gather(*(self._start_one(r) for r in replicas), return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:  # all or nothing: stop the ones that did start
            await asyncio.gather(*(r.shutdown() for r in replicas), return_exceptions=True)
            raise errors[0]

    async def _start_one(self, replica: EngineReplica) -> None:
        await replica.start()
        await self.prepare(replica)

    def shutdown(self) -> None:
        self.closed = True
        replicas = list(self.replicas.values())
        if replicas:
            run_in_thread(lambda: _gather_quietly(r.shutdown() for r in replicas))

    # ---- who serves ----------------------------------------------------------------------------
    def live(self) -> list[EngineReplica]:
        """Every replica that holds requests, draining ones included (fan-out reaches these)."""
        return [r for r in list(self.replicas.values()) if r.alive]

    def serving(self) -> list[EngineReplica]:
        """The replicas that take new requests."""
        return [r for r in self.live() if r.rank not in self.draining]

    # ---- elastic scaling -----------------------------------------------------------------------
    async def grow(self, size: int) -> None:
        free = (rank for rank in itertools.count() if rank not in self.replicas)
        ranks = [next(free) for _ in range(size - len(self.replicas))]
        new = [self.make(self.spec(rank, size)) for rank in ranks]
        await asyncio.to_thread(run_in_thread, lambda: self._start_all(new))
        with self._lock:
            self.replicas.update((r.rank, r) for r in new)
        await self._resplit_threads(size)

    async def _resplit_threads(self, size: int) -> None:
        """The replicas that stay take the new share of the threads (and keep it when restarted)."""
        share = self.spec(0, size).engine_args["threads"]
        for replica in self.live():
            if replica.spec.engine_args.get("threads") != share:
                replica.spec = self.spec(replica.rank, size)
                await replica.call("set_num_threads", share)

    async def shrink(self, size: int, in_flight: Callable[[int], int], timeout: float) -> None:
        """Stop the highest ranks: no new requests go to them, their running ones finish (up to
        ``timeout`` seconds; then they are stopped and what remains fails), then they go."""
        victims = sorted(self.replicas)[size:]
        self.draining.update(victims)
        deadline = time.monotonic() + timeout
        while any(in_flight(rank) for rank in victims) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        with self._lock:
            gone = [self.replicas.pop(rank) for rank in victims]
        self.draining.difference_update(victims)
        for rank in victims:
            self.on_gone(rank)
        await asyncio.to_thread(run_in_thread, lambda: _gather_quietly(r.shutdown() for r in gone))
        await self._resplit_threads(size)

    # ---- restarts ------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self.closed:
            time.sleep(_WATCH_PERIOD)
            for rank, replica in list(self.replicas.items()):
                if self.closed or replica.alive or rank in self.restarting or rank in self.draining:
                    continue
                self.restarting.add(rank)
                self.on_gone(rank)
                log.warning("replica %d died; restarting it", rank)
                threading.Thread(target=self._restart, args=(rank, replica.spec), daemon=True,
                                 name=f"runlm-dp-restart{rank}").start()

    def _restart(self, rank: int, spec: ReplicaSpec) -> None:
        for attempt in range(1 << 30):
            if self.closed or rank not in self.replicas:
                break
            replica = self.make(spec)
            try:
                run_in_thread(functools.partial(self._start_all, [replica]))
            except Exception as exc:
                pause = _RESTART_BACKOFF[min(attempt, len(_RESTART_BACKOFF) - 1)]
                log.error("replica %d failed to restart (%s); trying again in %.0f s", rank, exc, pause)
                time.sleep(pause)
                continue
            with self._lock:
                if self.closed or rank not in self.replicas:  # shut down or scaled away meanwhile
                    run_in_thread(functools.partial(_gather_quietly, [replica.shutdown()]))
                    break
                self.replicas[rank] = replica
                self.restarts += 1
            log.warning("replica %d is serving again", rank)
            break
        self.restarting.discard(rank)


async def _gather_quietly(coros: Any) -> None:
    await asyncio.gather(*coros, return_exceptions=True)
