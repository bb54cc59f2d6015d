"""AsyncLLM in process: the engine behind a server (vLLM's ``AsyncLLM``).

The engine core runs in its own thread, so the asyncio loop stays responsive while the
model computes (torch releases the GIL in its kernels). Everything that touches the engine
runs on that thread: callers submit commands and await their results; outputs come back to
each request's asyncio queue through ``call_soon_threadsafe``.

A request is added in an awaited step (``add_request``) that runs the engine's own checks on the
engine thread (prompt, sampling values, the grammar compile) and raises its typed errors
(runlm/engine/types/errors.py) before anything is streamed; a server answers them before it sends a
header. ``generate`` is add_request and the stream together.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar, Generic, TypeVar

from runlm.engine.core.detokenizer import DELTA, FINAL_ONLY
from runlm.engine.engine_core import EngineOutput, EngineStats
from runlm.engine.factory import EngineCoreType, engine_from_model
from runlm.engine.llm_engine import PromptType
from runlm.engine.pooling_engine import PoolingPromptType
from runlm.engine.profiler import EngineProfiler
from runlm.engine.rpc import engine_method
from runlm.engine.types.errors import EngineDeadError
from runlm.engine.types.lora_request import LoRARequest
from runlm.engine.types.outputs import PoolingRequestOutput, RequestOutput
from runlm.engine.types.pooling_params import PoolingParams
from runlm.engine.types.sampling_params import SamplingParams
from runlm.formats.tokenizer import Tokenizer

__all__ = ["AsyncLLM", "EngineDeadError", "RequestStream"]

OutputT = TypeVar("OutputT", RequestOutput, PoolingRequestOutput)


class RequestStream(Generic[OutputT]):
    """The outputs of one added request. Iterate it to the end, or ``aclose()`` it: a stream closed
    (or dropped) before its last output aborts the request and frees its KV blocks."""

    def __init__(self, llm: AsyncLLM, request_id: str, queue: asyncio.Queue) -> None:
        self.llm, self.request_id, self._queue = llm, request_id, queue
        self.finished = False
        self._closed = False

    def __aiter__(self) -> RequestStream[OutputT]:
        return self

    async def __anext__(self) -> OutputT:
        if self.finished or self._closed:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled while waiting: the consumer has gone
            self.close()
            raise
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.finished:
            self.finished = True
            self.close()
        return item

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.llm._streams.pop(self.request_id, None)
        if not self.finished and self.llm._dead is None:
            self.llm._abort_soon(self.request_id)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:  # dropped without being read to the end or closed
        if not self._closed:
            try:
                self.close()
            except Exception:  # at interpreter exit the engine may be gone already
                pass


class AsyncLLM:
    # the data-parallel front end (runlm/engine/parallel/client.py), a subclass that registers itself here;
    # runlm.engine.async_llm (where users import AsyncLLM from) loads it, so this module never imports it
    _data_parallel: ClassVar[type[AsyncLLM] | None] = None

    def __init_subclass__(cls, *, data_parallel: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if data_parallel:
            AsyncLLM._data_parallel = cls

    def __new__(cls, *args: Any, **kwargs: Any) -> AsyncLLM:
        """``data_parallel_size=N`` (N > 1) or a ``distributed_executor_backend`` gives the data-parallel
        front end (runlm/engine/parallel/client.py), a subclass with the same API; otherwise this in-process engine."""
        if cls is AsyncLLM and (kwargs.get("data_parallel_size", 1) != 1
                                or kwargs.get("distributed_executor_backend") is not None):
            if AsyncLLM._data_parallel is None:
                raise RuntimeError("the data-parallel front end is not loaded: import AsyncLLM from runlm "
                                   "or runlm.engine.async_llm")
            return super().__new__(AsyncLLM._data_parallel)
        return super().__new__(cls)

    def __init__(self, model: str | None = None, *, engine: EngineCoreType | None = None,
                 profiler_dir: str | None = None, data_parallel_size: int = 1, **engine_args: Any) -> None:
        """``profiler_dir``: where start_profile()/stop_profile() write traces (else $RUNLM_TORCH_PROFILER_DIR)."""
        if (model is None) == (engine is None):
            raise ValueError("give either a model or an engine")
        if data_parallel_size != 1:
            raise ValueError("data_parallel_size must be 1 for an in-process engine")
        self.engine: EngineCoreType = engine or engine_from_model(str(model), **engine_args)
        self._profiler = EngineProfiler(profiler_dir)
        self._cond = threading.Condition()
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._held: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()  # adds while paused
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._paused = False   # the engine thread does not step
        self._holding = False  # new requests are held (while pausing, and while paused)
        self._stopping = False
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="runlm-engine", daemon=True)
        self._thread.start()

    # ---- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopping and not self._commands and (
                            self._paused or not self.engine.has_unfinished_requests()):
                        self._cond.wait()
                    if self._stopping:
                        return
                    commands = list(self._commands)
                    self._commands.clear()
                for fn, fut in commands:
                    try:
                        outcome, ok = fn(), True
                    except BaseException as exc:  # the caller gets the error; the engine goes on
                        outcome, ok = exc, False
                    # a caller that stopped waiting cancelled its future: the command still ran (an add is
                    # aborted by the caller after), and nobody takes its outcome
                    with contextlib.suppress(concurrent.futures.InvalidStateError):
                        fut.set_result(outcome) if ok else fut.set_exception(outcome)
                if not self._paused and self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out.request_id, out)
                    for rid, error in self.engine.take_failures():  # (dropped by a step that ran out of memory)
                        self._deliver(rid, error)
        except BaseException as exc:
            self._dead = exc
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"the engine died: {exc!r}"))

    def _deliver(self, request_id: str, item: EngineOutput | BaseException) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, queue = entry
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed
                self._streams.pop(request_id, None)

    async def _call(self, fn: Callable[[], Any], hold_while_paused: bool = False) -> Any:
        """Run fn on the engine thread and await its result."""
        self.check_health_now()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            held = hold_while_paused and (self._paused or self._holding)
            (self._held if held else self._commands).append((fn, fut))
            self._cond.notify()
        return await asyncio.wrap_future(fut)

    # ---- what a server needs to know (so it never reaches into the engine core) ------------------
    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_num_seqs(self) -> int:
        """Sequences the engine runs at once; a server bounds waiting work beyond this."""
        return self.engine.max_num_seqs

    def replica_info(self) -> dict[str, Any]:
        """What a data-parallel front end needs of a replica to stand in for it (picklable)."""
        return {"tokenizer": self.tokenizer, "max_model_len": self.max_model_len, "vocab_size": self.vocab_size,
                "max_num_seqs": self.max_num_seqs, "supported_tasks": self.get_supported_tasks(),
                "modalities": self.modalities}

    @property
    def modalities(self) -> tuple[str, ...]:
        """What a prompt may hold: ("text",) or ("text", "image")."""
        return self.engine.modalities

    def stats(self) -> EngineStats:
        """The engine's EngineStats (read from the event loop: counters only, no engine state changes)."""
        return self.engine.stats()

    # ---- requests ---------------------------------------------------------------------------
    async def add_request(self, request_id: str | None, prompt: PromptType | PoolingPromptType,
                          params: SamplingParams | PoolingParams | None = None, priority: int = 0,
                          output_kind: str = DELTA, lora_request: LoRARequest | None = None,
                          data_parallel_rank: int | None = None) -> RequestStream:
        """Check and queue a request on the engine thread; raises the engine's typed errors (PromptError,
        SamplingParamsError, StructuredOutputsError, TaskError...) before any output. Returns its stream.
        ``data_parallel_rank``: the replica to run it on; this in-process engine is rank 0."""
        if data_parallel_rank not in (None, 0):
            raise ValueError(f"data_parallel_rank {data_parallel_rank} is not a replica (ranks: [0])")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        stream: RequestStream = RequestStream(self, request_id, queue)
        if params is None:
            params = SamplingParams()
        try:
            await self._call(lambda: self.engine.add_request(request_id, prompt, params, priority,  # type: ignore
                                                             time.monotonic(), output_kind, lora_request),
                             hold_while_paused=True)
        except asyncio.CancelledError:  # the add may still run on the engine thread: abort it after
            stream.close()
            raise
        except BaseException:
            stream.finished = True  # the engine refused it: nothing was queued, nothing to abort
            stream.close()
            raise
        return stream

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       output_kind: str = DELTA, lora_request: LoRARequest | None = None,
                       data_parallel_rank: int | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (by default each carries only what is new); aborted if the caller stops."""
        stream = await self.add_request(request_id, prompt, sampling_params or SamplingParams(), priority,
                                        output_kind, lora_request, data_parallel_rank)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def encode(self, prompt: PoolingPromptType, pooling_params: PoolingParams | None = None,
                     request_id: str | None = None, priority: int = 0,
                     lora_request: LoRARequest | None = None) -> AsyncIterator[PoolingRequestOutput]:
        """An embedding or score, batched with other requests by the same scheduler: a stream that
        yields one finished PoolingRequestOutput (the request is aborted if the caller stops waiting)."""
        params = pooling_params or PoolingParams(task="embed" if "embed" in self.get_supported_tasks() else "score")
        # the engine dispatches on the params' type, so one add step and stream serve both
        stream = await self.add_request(request_id, prompt, params, priority, FINAL_ONLY, lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _abort_soon(self, request_id: str) -> None:
        with self._cond:
            self._commands.append((lambda: self.engine.abort_request(request_id), concurrent.futures.Future()))
            self._cond.notify()

    async def abort(self, request_id: str | list[str]) -> None:
        """Stop requests and free their KV blocks now; their streams end with finish_reason 'abort'."""
        def run() -> None:
            for out in self.engine.abort_request(request_id):
                self._deliver(out.request_id, out)
        await self._call(run)

    # ---- control plane ----------------------------------------------------------------------
    async def pause_generation(self, mode: str = "abort") -> None:
        """Stop scheduling. 'abort': in-flight requests end now; 'wait': they finish first.
        Requests that arrive while pausing or paused wait for resume_generation()."""
        if mode not in ("wait", "abort"):
            raise ValueError("mode must be 'wait' or 'abort'")
        with self._cond:
            self._holding = True
        if mode == "abort":
            def run() -> None:
                for out in self.engine.abort_request(list(self.engine.requests)):
                    self._deliver(out.request_id, out)
            await self._call(run)
        else:
            await self.wait_for_requests_to_drain()
        with self._cond:
            self._paused = True

    async def resume_generation(self) -> None:
        with self._cond:
            self._paused = self._holding = False
            self._commands.extend(self._held)
            self._held.clear()
            self._cond.notify()

    async def is_paused(self) -> bool:
        return self._paused

    async def sleep(self, level: int = 1) -> None:
        await self.pause_generation(mode="wait")
        await self._call(lambda: self.engine.sleep(level))

    async def wake_up(self) -> None:
        await self._call(self.engine.wake_up)
        await self.resume_generation()

    async def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    async def reset_prefix_cache(self) -> None:
        await self._call(self.engine.reset_prefix_cache)

    async def reset_mm_cache(self) -> None:
        """Forget the images' embeddings (the encoder cache; vLLM's name)."""
        await self._call(self.engine.reset_mm_cache)

    # ---- LoRA adapters (run on the engine thread, between steps) --------------------------------
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        return await self._call(lambda: self.engine.add_lora(lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._call(lambda: self.engine.remove_lora(lora_id))

    async def list_loras(self) -> set[int]:
        return await self._call(self.engine.list_loras)

    async def pin_lora(self, lora_id: int) -> bool:
        return await self._call(lambda: self.engine.pin_lora(lora_id))

    # ---- profiling and named engine methods (run on the engine thread, where the model runs) ------
    async def start_profile(self) -> None:
        """Start a torch.profiler trace of the engine thread (see runlm/engine/profiler.py)."""
        await self._call(lambda: self._profiler.start(self.engine))

    async def stop_profile(self) -> list[str]:
        """Stop the trace and write it as Chrome trace JSON; returns its path (a list: one per replica)."""
        return [await self._call(self._profiler.stop)]

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run the engine core's public method ``method`` between steps; one result per replica (here one)."""
        fn = engine_method(self.engine, method)
        return [await self._call(lambda: fn(*args, **(kwargs or {})))]

    async def set_num_threads(self, threads: int) -> None:
        """The engine's CPU threads from now on (a data-parallel front end re-splits them when it scales)."""
        if threads < 1:
            raise ValueError("threads must be 1 or more")
        await self._call(lambda: self.engine.set_threads(threads))  # on the engine thread, which runs the kernels

    def check_health_now(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine died: {self._dead!r}")
        if not self._thread.is_alive() and not self._stopping:
            raise EngineDeadError("the engine thread is not running")
        try:
            self.engine.check_alive()
        except RuntimeError as exc:
            raise EngineDeadError(f"the engine died: {exc}") from None

    async def check_health(self) -> None:
        self.check_health_now()

    async def wait_for_requests_to_drain(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.engine.has_unfinished_requests() or self._commands:
            self.check_health_now()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"requests still running after {timeout} s")
            await asyncio.sleep(0.01)

    async def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_supported_tasks(self) -> tuple[str, ...]:
        return self.engine.supported_tasks

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=10)
