"""ProcessReplica: one AsyncLLM in a child process on this machine (``distributed_executor_backend="mp"``).

The child (runlm/engine/parallel/child.py) is started with multiprocessing's spawn context, so it gets
a fresh interpreter with its own torch threads (``num_threads``: its share, set before its engine
loads) and no inherited locks. One duplex pipe carries pickled messages both ways; a reader thread
here delivers outputs into each request's asyncio queue on the loop that added it (so the replica
is not tied to one event loop), and notices the pipe closing: the child died, every open stream
ends with ReplicaDeadError and every pending call fails with it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import multiprocessing
import threading
from collections.abc import AsyncIterator
from typing import Any

from runlm.engine.engine_core import EngineStats
from runlm.engine.parallel.child import child_main
from runlm.engine.parallel.replica import EngineReplica, RemoteError, ReplicaDeadError, ReplicaLoad, ReplicaSpec
from runlm.engine.types.lora_request import LoRARequest
from runlm.engine.types.outputs import PoolingRequestOutput, RequestOutput
from runlm.engine.types.pooling_params import PoolingParams
from runlm.engine.types.sampling_params import SamplingParams

__all__ = ["ProcessReplica"]

_CTX = multiprocessing.get_context("spawn")
_Output = RequestOutput | PoolingRequestOutput


class ProcessReplica(EngineReplica):
    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.info: dict[str, Any] = {}          # tokenizer, max_model_len, ... (from the child once ready)
        self.last_stats: EngineStats | None = None
        self._proc: Any = None
        self._conn: Any = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()           # the tables below are touched by the reader thread too
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._adds: dict[str, concurrent.futures.Future] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._dead: str | None = None
        self._closing = False

    # ---- life --------------------------------------------------------------------------------
    def launch(self) -> None:
        """Start the child process (it loads the model behind the scenes; see wait_ready)."""
        parent, child = _CTX.Pipe(duplex=True)
        self._proc = _CTX.Process(target=child_main, args=(child, self.spec), name=f"runlm-replica{self.rank}",
                                  daemon=True)
        self._proc.start()
        child.close()  # only the child holds its end: its death closes the pipe and wakes our reader
        self._conn = parent
        threading.Thread(target=self._read, name=f"runlm-replica{self.rank}-reader", daemon=True).start()

    def wait_ready(self, timeout: float | None = None) -> None:
        self._ready.result(timeout)

    async def start(self) -> None:
        if self._proc is None:
            self.launch()
        await asyncio.wrap_future(self._ready)

    @property
    def alive(self) -> bool:
        return self._dead is None and self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    async def shutdown(self) -> None:
        self.close()
        await asyncio.to_thread(self._reap)

    def close(self) -> None:
        """Ask the child to stop (its engine shuts down); the reader ends its open streams."""
        self._closing = True
        if self._conn is not None and self._dead is None:
            try:
                self._send(("shutdown",))
            except ReplicaDeadError:
                pass

    def _reap(self, timeout: float = 10.0) -> None:
        if self._proc is None:
            return
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    # ---- requests ----------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams | PoolingParams | None, *,
                          priority: int = 0, output_kind: str = "delta",
                          lora_request: LoRARequest | None = None) -> AsyncIterator[_Output]:
        queue: asyncio.Queue = asyncio.Queue()
        added: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._check()
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
            self._adds[request_id] = added
        try:
            self._send(("add", request_id, prompt, params or SamplingParams(), priority, output_kind,
                        lora_request))
            await asyncio.wrap_future(added)
        except asyncio.CancelledError:
            self._forget(request_id, abort=True)
            raise
        except BaseException:
            self._forget(request_id, abort=False)
            raise
        return _ProcessStream(self, request_id, queue)

    async def abort(self, request_ids: list[str]) -> None:
        if request_ids and self.alive:
            self._send(("abort", list(request_ids)))

    def _forget(self, request_id: str, abort: bool) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            self._adds.pop(request_id, None)
        if abort and self.alive:
            try:
                self._send(("abort", [request_id]))
            except ReplicaDeadError:
                pass

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._check()
            call_id = next(self._ids)
            self._calls[call_id] = fut
        self._send(("call", call_id, method, args, kwargs))
        return await asyncio.wrap_future(fut)

    def load(self) -> ReplicaLoad:
        in_flight = len(self._streams)
        running = min(in_flight, self.last_stats.num_running) if self.last_stats else in_flight
        return ReplicaLoad(waiting=in_flight - running, running=running)

    # ---- the pipe ----------------------------------------------------------------------------
    def _check(self) -> None:
        if self._dead is not None:
            raise ReplicaDeadError(self._dead)
        if self._closing:
            raise ReplicaDeadError(f"replica {self.rank} is shutting down")

    def _send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError) as exc:  # the pipe is closed: the child is gone
            raise ReplicaDeadError(self._dead or f"replica {self.rank} is gone: {exc}") from None

    def _read(self) -> None:
        conn = self._conn
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            except Exception as exc:  # a message that does not unpickle here: say so, keep reading
                msg = ("garbled", exc)
            self._dispatch(msg)
        self._on_death()

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "outs":
            for rid, item in msg[1]:
                self._deliver(rid, item.rebuild() if isinstance(item, RemoteError) else item)
        elif kind == "stats":
            self.last_stats = msg[1]
        elif kind == "added":
            with self._lock:
                fut = self._adds.pop(msg[1], None)
                if msg[2] is not None:
                    self._streams.pop(msg[1], None)
            if fut is not None:
                _settle(fut, error=None if msg[2] is None else msg[2].rebuild())
        elif kind == "result":
            with self._lock:
                fut = self._calls.pop(msg[1], None)
            if fut is not None:
                _settle(fut, value=msg[3]) if msg[2] else _settle(fut, error=msg[3].rebuild())
        elif kind == "ready":
            self.info = msg[1]
            _settle(self._ready, value=None)
        elif kind == "failed":
            _settle(self._ready, error=msg[1].rebuild())

    def _deliver(self, rid: str, item: Any) -> None:
        with self._lock:
            entry = self._streams.get(rid)
            if entry is not None and (isinstance(item, BaseException) or item.finished):
                self._streams.pop(rid, None)  # its last item: the replica no longer holds it
        if entry is not None:
            loop, queue = entry
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # that loop is closed: nobody is reading
                pass

    def _on_death(self) -> None:
        self._proc.join(1.0)
        code = self._proc.exitcode
        self._dead = (f"replica {self.rank} was shut down" if self._closing else
                      f"replica {self.rank} (pid {self._proc.pid}) died (exit code {code})")
        error = ReplicaDeadError(self._dead)
        with self._lock:
            streams = list(self._streams.values())
            pending = list(self._adds.values()) + list(self._calls.values())
            self._streams.clear()
            self._adds.clear()
            self._calls.clear()
        _settle(self._ready, error=error)
        for fut in pending:
            _settle(fut, error=error)
        for loop, queue in streams:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, error)
            except RuntimeError:
                pass
        self._conn.close()


def _settle(fut: concurrent.futures.Future, value: Any = None, error: BaseException | None = None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


class _ProcessStream:
    """One request's outputs from a ProcessReplica; closing it before the end aborts the request."""

    def __init__(self, replica: ProcessReplica, request_id: str, queue: asyncio.Queue) -> None:
        self.replica, self.request_id, self._queue = replica, request_id, queue
        self.done = False

    def __aiter__(self) -> _ProcessStream:
        return self

    async def __anext__(self) -> _Output:
        if self.done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:
            self.close()
            raise
        if isinstance(item, BaseException):
            self.done = True
            raise item
        if item.finished:
            self.done = True
        return item

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.replica._forget(self.request_id, abort=True)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit the pipe may be gone already
            pass
