"""DPAsyncLLM: one front end over N engine replicas (vLLM's data-parallel AsyncLLM).

``AsyncLLM(model, data_parallel_size=N, distributed_executor_backend="mp" | "ray")`` builds this
subclass: the same API, with each request routed to one replica (runlm/engine/parallel/router.py: load with
prefix affinity; ``data_parallel_rank`` pins it), and the control plane (sleep/wake, pause/resume,
drain, prefix-cache reset, LoRA adapters, profiling, ``collective_rpc``) fanned out to every replica.
``scale_elastic_ep(n)`` grows or shrinks the set (runlm/engine/parallel/pool.py), which also restarts a
replica that dies. A request whose replica died fails with ReplicaDeadError, or is sent to another
replica when none of its output was streamed yet.
"""
from __future__ import annotations

import asyncio
import uuid
from typing import Any

from runlm.engine.async_inproc import AsyncLLM, RequestStream
from runlm.engine.core.detokenizer import DELTA
from runlm.engine.engine_core import EngineStats
from runlm.engine.llm_engine import PromptType
from runlm.engine.parallel.pool import ReplicaPool, replica_devices, replica_factory
from runlm.engine.parallel.replica import EngineReplica, ReplicaDeadError
from runlm.engine.parallel.router import PrefixRouter
from runlm.engine.pooling_engine import PoolingPromptType
from runlm.engine.types.config import physical_cores
from runlm.engine.types.errors import EngineDeadError
from runlm.engine.types.lora_request import LoRARequest
from runlm.engine.types.pooling_params import PoolingParams
from runlm.engine.types.sampling_params import SamplingParams
from runlm.formats.tokenizer import Tokenizer
from runlm.sizes import gpu_memories

__all__ = ["DPAsyncLLM", "DPRequestStream"]


class DPAsyncLLM(AsyncLLM, data_parallel=True):
    def __init__(self, model: str | None = None, *, engine: Any = None, data_parallel_size: int = 1,
                 distributed_executor_backend: str | None = "mp", ray_address: str | None = None,
                 profiler_dir: str | None = None, **engine_args: Any) -> None:
        """``model``: a built-in name, a .gguf file or a model directory, resolved by each replica;
        ``threads`` (default: this machine's cores) is split between the replicas, at least one each."""
        if engine is not None or model is None:
            raise ValueError("a data-parallel AsyncLLM takes a model (each replica builds its own engine)")
        if data_parallel_size < 1:
            raise ValueError("data_parallel_size must be 1 or more")
        backend = distributed_executor_backend or "mp"
        options = {"ray_address": ray_address or "auto"} if backend == "ray" else {}
        total = engine_args.pop("threads", None) or physical_cores()
        self._router = PrefixRouter()
        self._owner: dict[str, int] = {}            # request id -> the rank that holds it
        self._loras: dict[int, LoRARequest] = {}    # adapters every replica (and every new one) gets
        self._paused_mode: str | None = None
        self._sleep_level = 0
        self._scale_lock: asyncio.Lock | None = None
        self.data_parallel_backend = backend
        devices = replica_devices(engine_args.get("device"), backend, len(gpu_memories()))  # (one GPU a replica)
        self._pool = ReplicaPool(str(model), dict(engine_args, profiler_dir=profiler_dir), total,
                                 replica_factory(backend, **options), self._prepare, self._router.forget, devices)
        self._pool.start(data_parallel_size)
        first = self._pool.replicas[0]
        self._info: dict[str, Any] = getattr(first, "info", None) or {}
        if not self._info:
            self._info = _run_call(first, "replica_info")

    async def _prepare(self, replica: EngineReplica) -> None:
        """A new or restarted replica takes on the front end's state before it serves."""
        for lora in self._loras.values():
            await replica.call("add_lora", lora)
        if self._sleep_level:
            await replica.call("sleep", self._sleep_level)
        elif self._paused_mode is not None:
            await replica.call("pause_generation", self._paused_mode)

    # ---- what a server needs to know ---------------------------------------------------------------
    @property
    def replicas(self) -> dict[int, EngineReplica]:
        return dict(self._pool.replicas)

    @property
    def data_parallel_size(self) -> int:
        return len(self._pool.replicas)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._info["tokenizer"]

    @property
    def max_model_len(self) -> int:
        return self._info["max_model_len"]

    @property
    def vocab_size(self) -> int:
        return self._info["vocab_size"]

    @property
    def max_num_seqs(self) -> int:
        return self._info["max_num_seqs"] * max(1, len(self._pool.serving()))

    def get_supported_tasks(self) -> tuple[str, ...]:
        return self._info["supported_tasks"]

    @property
    def modalities(self) -> tuple[str, ...]:
        return self._info.get("modalities", ("text",))

    async def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def replica_info(self) -> dict[str, Any]:
        return dict(self._info)

    def replica_stats(self) -> list[tuple[int, EngineStats]]:
        """Each replica's last known counters, by rank (for /metrics' per-replica series)."""
        out = []
        for rank, r in sorted(self._pool.replicas.items()):
            stats = getattr(r, "last_stats", None)
            if stats is None:
                load = r.load()
                stats = EngineStats(load.running, load.waiting, 0.0, 0, 0, 0)
            out.append((rank, stats))
        return out

    def stats(self) -> EngineStats:
        """The replicas' counters summed (KV-cache usage averaged)."""
        per = [s for _, s in self.replica_stats()]
        return EngineStats(num_running=sum(s.num_running for s in per), num_waiting=sum(s.num_waiting for s in per),
                           kv_cache_usage=sum(s.kv_cache_usage for s in per) / max(1, len(per)),
                           prefix_cache_queries=sum(s.prefix_cache_queries for s in per),
                           prefix_cache_hits=sum(s.prefix_cache_hits for s in per),
                           num_preemptions=sum(s.num_preemptions for s in per),
                           num_generation_tokens=sum(s.num_generation_tokens for s in per))

    # ---- requests ----------------------------------------------------------------------------------
    async def add_request(self, request_id: str | None, prompt: PromptType | PoolingPromptType,
                          params: SamplingParams | PoolingParams | None = None, priority: int = 0,
                          output_kind: str = DELTA, lora_request: LoRARequest | None = None,
                          data_parallel_rank: int | None = None) -> DPRequestStream:
        """Route and queue a request (``data_parallel_rank`` pins it to that replica); raises the
        engine's typed errors before any output, as AsyncLLM does."""
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        if data_parallel_rank is not None and data_parallel_rank not in self._pool.replicas:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} is not a replica (ranks: "
                             f"{sorted(self._pool.replicas)})")
        stream = DPRequestStream(self, request_id, (prompt, params or SamplingParams(), priority, output_kind,
                                                    lora_request), data_parallel_rank)
        await stream.open()
        return stream

    def _route(self, prompt: Any, pinned: int | None, exclude: set[int]) -> EngineReplica:
        self.check_health_now()
        if pinned is not None:
            replica = self._pool.replicas.get(pinned)
            if replica is None or not replica.alive:
                raise ReplicaDeadError(f"replica {pinned} is not serving (restarting)")
            if pinned in self._pool.draining:
                raise ValueError(f"replica {pinned} is being removed and takes no new requests")
            return replica
        candidates = [r for r in self._pool.serving() if r.rank not in exclude]
        if not candidates:
            raise ReplicaDeadError("no replica can take the request (all have died and are restarting)")
        replica, hashes = self._router.choose(prompt, candidates)
        self._router.record(replica.rank, hashes)
        return replica

    async def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        by_rank: dict[int, list[str]] = {}
        for rid in ids:
            if rid in self._owner:
                by_rank.setdefault(self._owner[rid], []).append(rid)
        for rank, rids in by_rank.items():
            replica = self._pool.replicas.get(rank)
            if replica is not None and replica.alive:
                await replica.abort(rids)

    def in_flight(self, rank: int) -> int:
        return sum(1 for r in list(self._owner.values()) if r == rank)

    # ---- the control plane, on every replica -------------------------------------------------------
    async def _fan_out(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        replicas = self._pool.live()
        return list(await asyncio.gather(*(r.call(method, *args, **kwargs) for r in replicas)))

    async def pause_generation(self, mode: str = "abort") -> None:
        if mode not in ("wait", "abort"):
            raise ValueError("mode must be 'wait' or 'abort'")
        self._paused_mode = mode
        await self._fan_out("pause_generation", mode)

    async def resume_generation(self) -> None:
        self._paused_mode = None
        await self._fan_out("resume_generation")

    async def is_paused(self) -> bool:
        return self._paused_mode is not None or self._sleep_level > 0

    async def sleep(self, level: int = 1) -> None:
        self._sleep_level = level
        await self._fan_out("sleep", level)

    async def wake_up(self) -> None:
        self._sleep_level = 0
        await self._fan_out("wake_up")

    async def is_sleeping(self) -> bool:
        return any(await self._fan_out("is_sleeping"))

    async def reset_prefix_cache(self) -> None:
        self._router.clear()
        await self._fan_out("reset_prefix_cache")

    async def reset_mm_cache(self) -> None:
        await self._fan_out("reset_mm_cache")

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        ok = all(await self._fan_out("add_lora", lora_request))
        if ok:
            self._loras[lora_request.lora_int_id] = lora_request
        return ok

    async def remove_lora(self, lora_id: int) -> bool:
        self._loras.pop(lora_id, None)
        return any(await self._fan_out("remove_lora", lora_id))

    async def list_loras(self) -> set[int]:
        return set().union(*await self._fan_out("list_loras"))

    async def pin_lora(self, lora_id: int) -> bool:
        return all(await self._fan_out("pin_lora", lora_id))

    async def start_profile(self) -> None:
        await self._fan_out("start_profile")

    async def stop_profile(self) -> list[str]:
        """One Chrome trace per replica; their paths."""
        return [path for paths in await self._fan_out("stop_profile") for path in paths]

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """The engine method's result from every replica, in rank order."""
        replicas = sorted(self._pool.live(), key=lambda r: r.rank)
        results = await asyncio.gather(*(r.call("collective_rpc", method, args, kwargs) for r in replicas))
        return [item for per in results for item in per]

    async def wait_for_requests_to_drain(self, timeout: float | None = None) -> None:
        await self._fan_out("wait_for_requests_to_drain", timeout)

    async def scale_elastic_ep(self, new_data_parallel_size: int, drain_timeout: float = 300.0) -> None:
        """Grow to or shrink to ``new_data_parallel_size`` replicas (vLLM's name). New replicas serve
        once loaded; removed ones take no new requests and are stopped once their requests finish."""
        if not isinstance(new_data_parallel_size, int) or new_data_parallel_size < 1:
            raise ValueError("new_data_parallel_size must be a whole number, 1 or more")
        if self._scale_lock is None:
            self._scale_lock = asyncio.Lock()
        async with self._scale_lock:
            current = len(self._pool.replicas)
            if new_data_parallel_size > current:
                await self._pool.grow(new_data_parallel_size)
            elif new_data_parallel_size < current:
                await self._pool.shrink(new_data_parallel_size, self.in_flight, drain_timeout)

    # ---- health and life ---------------------------------------------------------------------------
    def check_health_now(self) -> None:
        if self._pool.closed:
            raise EngineDeadError("the engine was shut down")
        if not self._pool.live():
            if not self._pool.restarting:
                raise EngineDeadError("every replica has died")
            raise ReplicaDeadError(f"no replica is serving: {len(self._pool.restarting)} restarting")

    async def check_health(self) -> None:
        self.check_health_now()

    def shutdown(self) -> None:
        if not self._pool.closed:
            self._pool.shutdown()


def _run_call(replica: EngineReplica, method: str) -> Any:
    from runlm.engine.parallel.pool import run_in_thread
    return run_in_thread(lambda: replica.call(method))


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
