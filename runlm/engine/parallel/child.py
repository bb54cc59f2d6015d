"""The child side of a ProcessReplica: one AsyncLLM served over a multiprocessing pipe.

Messages are pickled tuples. From the front end: ``("add", rid, prompt, params, priority, output_kind,
lora)``, ``("abort", [rid...])``, ``("call", call_id, method, args, kwargs)``, ``("shutdown",)``. To it:
``("ready", info)`` or ``("failed", error)`` once, then ``("added", rid, error|None)``, ``("outs", [(rid,
output|error)...])`` (the outputs of one loop turn in one message), ``("result", call_id, ok, value)``
and ``("stats", EngineStats)`` when they change. The pipe closing (the front end gone) stops the child.
"""
from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any

from runlm.engine.parallel.replica import RemoteError, ReplicaSpec, call_method

__all__ = ["child_main"]

log = logging.getLogger("runlm.engine.parallel.replica")

_STATS_PERIOD = 0.2  # seconds between checks of the engine's counters (sent only when they change)

def child_main(conn: Connection, spec: ReplicaSpec) -> None:
    """The child process's entry point (multiprocessing spawn)."""
    # Ctrl-C reaches the whole process group: the front end decides when a replica stops (it closes
    # the pipe, or asks), so a terminal's SIGINT does not kill replicas under a server shutting down
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threads = spec.engine_args.get("threads")
    if threads:  # this replica's share of the machine, for the libraries that read it
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    logging.basicConfig(level=os.environ.get("RUNLM_LOG_LEVEL", "WARNING").upper(),
                        format=f"%(asctime)s %(levelname)s replica{spec.rank}: %(message)s")
    try:
        asyncio.run(_ChildServer(conn, spec).serve())
    except (KeyboardInterrupt, BrokenPipeError, EOFError):
        pass


class _ChildServer:
    def __init__(self, conn: Connection, spec: ReplicaSpec) -> None:
        self.conn, self.spec = conn, spec
        self.streams: dict[str, Any] = {}
        self.adding: set[str] = set()
        self.aborted_early: set[str] = set()
        self.pending: list[tuple[str, Any]] = []
        self.tasks: set[asyncio.Task] = set()

    def send(self, msg: tuple) -> None:
        self.conn.send(msg)

    async def serve(self) -> None:
        from runlm.engine.async_inproc import AsyncLLM

        self.loop = asyncio.get_running_loop()
        try:
            self.llm = await asyncio.to_thread(AsyncLLM, self.spec.model, **self.spec.engine_args)
        except BaseException as exc:
            self.send(("failed", RemoteError.of(exc)))
            return
        llm = self.llm
        llm._profiler.name = f"replica{self.spec.rank}"  # one trace per replica, named for it
        self.send(("ready", llm.replica_info() | {"pid": os.getpid()}))
        inbox: asyncio.Queue = asyncio.Queue()
        threading.Thread(target=self._read, args=(inbox,), name="runlm-replica-inbox", daemon=True).start()
        self._spawn(self._push_stats())
        try:
            while True:
                msg = await inbox.get()
                kind = msg[0]
                if kind == "add":
                    self.adding.add(msg[1])
                    self._spawn(self._add(*msg[1:]))
                elif kind == "abort":
                    self._spawn(self._abort(msg[1]))
                elif kind == "call":
                    self._spawn(self._call(*msg[1:]))
                else:  # "shutdown", or the front end is gone
                    break
        finally:
            llm.shutdown()

    def _read(self, inbox: asyncio.Queue) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                msg = ("shutdown",)
            self.loop.call_soon_threadsafe(inbox.put_nowait, msg)
            if msg[0] == "shutdown":
                return

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _emit(self, rid: str, item: Any) -> None:
        """Outputs of one loop turn go out together: one pickle and one write for a whole engine step."""
        if not self.pending:
            self.loop.call_soon(self._flush)
        self.pending.append((rid, item))

    def _flush(self) -> None:
        batch, self.pending = self.pending, []
        if batch:
            self.send(("outs", batch))

    async def _add(self, rid: str, prompt: Any, params: Any, priority: int, output_kind: str, lora: Any) -> None:
        try:
            stream = await self.llm.add_request(rid, prompt, params, priority, output_kind, lora)
        except BaseException as exc:
            self.send(("added", rid, RemoteError.of(exc)))
            return
        finally:
            self.adding.discard(rid)
        self.streams[rid] = stream
        self.send(("added", rid, None))
        if rid in self.aborted_early:  # the abort overtook the add
            self.aborted_early.discard(rid)
            await self.llm.abort(rid)
        try:
            async for out in stream:
                self._emit(rid, out)
        except Exception as exc:
            self._emit(rid, RemoteError.of(exc))
        finally:
            self.streams.pop(rid, None)

    async def _abort(self, rids: list[str]) -> None:
        self.aborted_early.update(r for r in rids if r in self.adding)
        live = [r for r in rids if r in self.streams]
        if live:  # their streams get a last output (finish_reason "abort"), which the front end drops
            await self.llm.abort(live)

    async def _call(self, call_id: int, method: str, args: tuple, kwargs: dict) -> None:
        try:
            result = await call_method(self.llm, method, args, kwargs)
        except Exception as exc:
            self.send(("result", call_id, False, RemoteError.of(exc)))
            return
        self.send(("result", call_id, True, result))

    async def _push_stats(self) -> None:
        last = b""
        while True:
            stats = pickle.dumps(self.llm.stats())  # compared as bytes: nested counters may be shared objects
            if stats != last:
                self.send(("stats", pickle.loads(stats)))
                last = stats
            await asyncio.sleep(_STATS_PERIOD)
