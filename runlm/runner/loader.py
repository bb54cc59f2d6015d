"""Loads models on demand into backend processes and unloads them (keep_alive, memory, death).

Invariants: one load per (backend, model, mode) at a time, shared by every request that waits
for it; memory decisions are made one at a time under ``_memory_lock``; a runner is evicted
only while no request uses it; a runner whose process dies leaves ``runners`` at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import httpx

from runlm.runner.backends import DEFAULT_BACKEND, IMAGE_BACKEND, Backend, BackendError
from runlm.runner.backends.base import RequiredMemory
from runlm.runner.backends.native import estimated_kv_dtype
from runlm.runner.config import KEEP_ALIVE_DEFAULT, BackendConfig, BackendMode, ConfigError
from runlm.runner.errors import BackendUnavailable, BadRequest, Busy, Conflict, ModelTooLarge, NotFound
from runlm.runner.health import watch_health
from runlm.runner.memory import MemoryBudget, human_size
from runlm.runner.ollama_options import LoadOptions
from runlm.runner.runner import Runner, RunnerKey, backend_client
from runlm.store import InvalidNameError, ModelNotFoundError, ModelStore, StoredModel
from runlm.store.names import ModelName

LOAD_TIMEOUT = float(os.environ.get("RUNLM_LOAD_TIMEOUT", "600"))
ROOM_WAIT_SECONDS = 30.0
FRESH_RUNNER_GRACE_SECONDS = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Loader:
    def __init__(self, store: ModelStore, backends: dict[str, Backend], budget: MemoryBudget,
                 default_keep_alive: float = KEEP_ALIVE_DEFAULT) -> None:
        self.store, self.backends, self.budget = store, backends, budget
        self.default_keep_alive = default_keep_alive
        self.runners: dict[RunnerKey, Runner] = {}
        # settings from _configure, per (model id, backend): runtime flags mean something to one backend only
        self.configs: dict[tuple[str, str], BackendConfig] = {}
        self.preferred_backend: dict[str, str] = {}  # model id -> backend named in its _configure
        self.lora_models: dict[str, str] = {}  # LoRA adapter name -> the stored model it adapts (runner.lora)
        self._loading: dict[RunnerKey, asyncio.Task] = {}
        self._memory_lock = asyncio.Lock()
        self._released = asyncio.Condition()
        # AF_UNIX paths are limited to ~107 bytes: keep sockets in a short private directory
        self._socket_dir = Path(tempfile.mkdtemp(prefix="runlm-"))
        self._counter = 0
        self._janitor: asyncio.Task | None = None
        self._health: asyncio.Task | None = None

    # --- lookups -------------------------------------------------------------------------------
    async def model(self, name: str) -> StoredModel:
        """The stored model ``name`` names (a LoRA adapter's name: the model it adapts)."""
        try:
            return await asyncio.to_thread(self.store.ensure, self.lora_models.get(name, name))
        except InvalidNameError as exc:
            raise BadRequest(str(exc), param="model") from None
        except ModelNotFoundError as exc:
            raise NotFound(str(exc), param="model", code="model_not_found") from None

    def backend(self, name: str | None, model: StoredModel | None = None) -> Backend:
        configured = self.preferred_backend.get(model.id) if model else None
        default = IMAGE_BACKEND if model and "image-generation" in model.info.capabilities else DEFAULT_BACKEND
        chosen = name or configured or default
        backend = self.backends.get(chosen)
        if backend is None:
            raise NotFound(f"unknown backend {chosen!r} (backends: {', '.join(self.backends)})", param="backend")
        return backend

    def config_for(self, model: StoredModel, backend: str) -> BackendConfig:
        return self.configs.get((model.id, backend), BackendConfig())

    def is_loaded(self, model: StoredModel) -> bool:
        return any(r.model.id == model.id for r in self.runners.values())

    def used(self) -> RequiredMemory:
        return sum((r.memory for r in self.runners.values()), RequiredMemory(0, 0))

    # --- using a model -------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def use(self, name: str, backend: str | None = None, mode: BackendMode = BackendMode.COMPLETION,
                  keep_alive: float | None = None) -> AsyncIterator[Runner]:
        runner = await self.acquire(name, backend, mode)
        try:
            yield runner
        finally:
            self.release(runner, keep_alive)

    async def acquire(self, name: str, backend_name: str | None = None,
                      mode: BackendMode = BackendMode.COMPLETION, load: LoadOptions | None = None) -> Runner:
        """The model's runner, held until ``release``; loaded first where none is, and reloaded where the one
        loaded does not meet ``load`` (Ollama's num_ctx, num_batch, num_thread) once no request holds it."""
        model = await self.model(name)
        backend = self.backend(backend_name, model)
        caps = model.info.capabilities
        # an image model does nothing else, and only an image model generates images
        if (mode is BackendMode.COMPLETION and "completion" not in caps) or \
                (mode is BackendMode.IMAGE_GENERATION) != ("image-generation" in caps):
            what = ", ".join(caps)
            hint = "; use POST /v1/images/generations" if "image-generation" in caps else ""
            raise BadRequest(f"model {str(model.name)!r} cannot do {mode.value} (it is a {what} model){hint}",
                             param="model", code="unsupported_mode")
        if mode not in backend.modes:
            raise BadRequest(f"the {backend.name} backend cannot serve {mode.value} "
                             f"(it serves: {', '.join(m.value for m in backend.modes)})",
                             param="backend", code="unsupported_mode")
        key: RunnerKey = (backend.name, model.id, mode)
        while True:
            runner = self.runners.get(key)
            if runner is not None and runner.stopping and runner.task is not None:
                await asyncio.wait({runner.task})  # let the old process go before starting a new one
                continue
            if runner is not None and runner.ready and not runner.dead:
                if load and not self._meets(runner, load):
                    await self._replace(runner)
                    continue
                runner.in_use += 1
                runner.expires_at = None
                return runner
            task = self._loading.get(key)
            if task is None:
                task = asyncio.create_task(self._load(key, backend, model, mode, load))
                self._loading[key] = task
                task.add_done_callback(lambda _t, key=key: self._loading.pop(key, None))  # type: ignore[misc]
            await asyncio.shield(task)  # a client that gives up does not cancel the shared load

    def _meets(self, runner: Runner, load: LoadOptions) -> bool:
        context = runner.backend.context_size(runner.model, runner.config)
        return load.met_by(context, runner.model.info.context_length or context, runner.config)

    async def _replace(self, runner: Runner) -> None:
        """Unload ``runner`` once its requests are done (the next acquire loads it again as asked)."""
        while runner.in_use and not runner.dead:
            async with self._released:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._released.wait(), 1.0)
        if not runner.dead and not runner.in_use:
            await self.unload(runner)

    def release(self, runner: Runner, keep_alive: float | None = None) -> None:
        runner.in_use = max(0, runner.in_use - 1)
        runner.last_used = time.monotonic()
        if keep_alive is not None:
            runner.keep_alive = keep_alive  # Ollama: a request's keep_alive holds until the next one
        if runner.in_use == 0 and not runner.dead:
            if runner.keep_alive == 0:
                asyncio.get_running_loop().create_task(self.unload_if_idle(runner))
            elif runner.keep_alive > 0:
                runner.expires_at = time.time() + runner.keep_alive
        asyncio.get_running_loop().create_task(self._notify_released())

    async def _notify_released(self) -> None:
        async with self._released:
            self._released.notify_all()

    # --- loading -------------------------------------------------------------------------------
    async def _load(self, key: RunnerKey, backend: Backend, model: StoredModel, mode: BackendMode,
                    load: LoadOptions | None = None) -> Runner:
        if not backend.installed():
            raise BackendUnavailable(f"backend {backend.name!r} cannot run models: {backend.status()}")
        config = await self._resolved_config(model, backend.name)
        if load:
            config = load.apply(config)
        try:
            backend.check_config(config)
        except ConfigError as exc:
            raise BadRequest(str(exc)) from None
        need = backend.required_memory(model, config)
        if not self.budget.can_ever_fit(need):
            gpu = f" and {human_size(need.vram)} of one GPU's" if need.vram and self.budget.gpus else ""
            raise ModelTooLarge(
                f"model {str(model.name)!r} needs {human_size(need.ram)} of memory{gpu} with the {backend.name} "
                f"backend (weights, KV cache for {config.context_size or 'the default'} context, runtime) but the "
                f"memory budget is {self.budget.describe()}; use a smaller context size or a larger budget "
                f"(runlm serve --memory-budget)", code="model_too_large")
        path = await asyncio.to_thread(self.store.model_path, model)
        async with self._memory_lock:
            placed = await self._make_room(need, model)
            if placed.gpu is not None and len(self.budget.gpus) > 1:  # (its process is given that GPU alone)
                config = replace(config, gpu=placed.gpu)
            self._counter += 1
            address = f"127.0.0.1:{_free_port()}" if backend.uses_tcp else \
                str(self._socket_dir / f"{backend.name}-{self._counter}.sock")
            keep_alive = config.keep_alive if config.keep_alive is not None else self.default_keep_alive
            runner = Runner(backend, model, mode, config, address, placed, keep_alive,
                            backend_client(address, backend.uses_tcp, backend.api_key_for(address)))
            self.runners[key] = runner
        runner.task = asyncio.create_task(self._run(runner, str(path)))
        try:
            await self._wait_ready(runner)
        except BaseException:
            await self.unload(runner)
            raise
        runner.ready = True
        # until a request takes it (a load whose clients all hung up must still expire); the grace
        # keeps the janitor off a fresh runner before its waiting requests have resumed
        grace = max(runner.keep_alive, FRESH_RUNNER_GRACE_SECONDS)
        runner.expires_at = time.time() + grace if runner.keep_alive >= 0 else None
        return runner

    async def _resolved_config(self, model: StoredModel, backend: str) -> BackendConfig:
        config = self.config_for(model, backend)
        if config.speculative and config.speculative.draft_model_path is None:
            draft = await self.model(config.speculative.draft_model)
            path = await asyncio.to_thread(self.store.model_path, draft)
            per_token = draft.info.kv_cache_bytes_per_token(estimated_kv_dtype(draft, config))  # (the target's kind)
            config = replace(config, speculative=replace(config.speculative, draft_model_path=str(path),
                                                         draft_kv_bytes_per_token=per_token))
        return config

    async def _make_room(self, need: RequiredMemory, model: StoredModel) -> RequiredMemory:
        """``need`` placed (its GPU chosen where it needs one) once the budget has room: idle models unloaded,
        least recently used first, or a wait for a busy one to finish."""
        deadline = time.monotonic() + ROOM_WAIT_SECONDS
        while (placed := self.budget.place((r.memory for r in self.runners.values()), need)) is None:
            ram_short = self.used().ram + need.ram > self.budget.ram  # (else a GPU is: only a GPU's model helps)
            idle = [r for r in self.runners.values() if r.ready and r.in_use == 0 and not r.stopping
                    and (ram_short or r.memory.vram)]
            if idle:
                await self.unload(min(idle, key=lambda r: r.last_used))  # least recently used first
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise Busy(f"not enough free memory for {str(model.name)!r} and every loaded model is in use; "
                           f"try again when a request finishes", code="busy")
            async with self._released:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._released.wait(), left)
        return placed

    async def _run(self, runner: Runner, path: str) -> None:
        try:
            await runner.backend.run(runner.address, path, runner.model_ref, runner.mode, runner.config,
                                     stored=runner.model)
        except asyncio.CancelledError:
            pass
        except (BackendError, ConfigError, OSError) as exc:
            runner.error = str(exc)
        finally:
            runner.dead = True
            if self.runners.get(runner.key) is runner:
                del self.runners[runner.key]
            await runner.client.aclose()
            if not runner.backend.uses_tcp:
                Path(runner.address).unlink(missing_ok=True)
            await self._notify_released()

    async def _wait_ready(self, runner: Runner) -> None:
        deadline = time.monotonic() + LOAD_TIMEOUT
        while time.monotonic() < deadline:
            if runner.task is not None and runner.task.done():
                raise BackendUnavailable(f"model {runner.model_ref!r} failed to load: {runner.error or 'stopped'}",
                                         code="load_failed")
            try:
                resp = await runner.client.get(runner.backend.health_path, timeout=2.0)
                if resp.status_code == 200:
                    return
            except (httpx.HTTPError, RuntimeError):
                pass  # not listening yet (RuntimeError: the client closed because the process died)
            await asyncio.sleep(0.1)
        raise BackendUnavailable(f"model {runner.model_ref!r} did not become ready within {LOAD_TIMEOUT:.0f}s",
                                 code="load_timeout")

    # --- unloading -----------------------------------------------------------------------------
    async def unload(self, runner: Runner) -> None:
        """Stop the runner's process; it leaves ``runners`` (and frees its memory) once the process has exited."""
        runner.stopping = True
        if runner.task is None or runner.task.done():
            if self.runners.get(runner.key) is runner:
                del self.runners[runner.key]
            return
        runner.task.cancel()
        await asyncio.wait({runner.task})

    async def unload_if_idle(self, runner: Runner) -> bool:
        """Unload the runner only if no request holds it at this moment (one may have taken it since it was
        chosen); a busy one gets keep_alive 0, so it goes when its last request ends."""
        if runner.in_use:
            runner.keep_alive = 0
            return False
        await self.unload(runner)
        return True

    async def unload_idle_models(self, name: str) -> None:
        """Ollama's keep_alive 0: unload the model's idle runners now, the busy ones after their requests."""
        model_id = (await self.model(name)).id
        await asyncio.gather(*(self.unload_if_idle(r) for r in list(self.runners.values()) if r.model.id == model_id))

    async def unload_models(self, names: list[str] | None, backend: str | None = None) -> int:
        """Unload the named models (every model when ``names`` is None); returns how many runners stopped."""
        ids = None
        if names is not None:
            ids = {(await self.model(n)).id for n in names}
        return await self._unload_where(lambda r: (ids is None or r.model.id in ids)
                                        and (backend is None or r.backend.name == backend))

    async def unload_idle_named(self, name: ModelName) -> int:
        """Unload the idle runners loaded under ``name`` (not those of other names for the same weights)."""
        return await self._unload_where(lambda r: r.model.name == name and not r.in_use)

    async def _unload_where(self, chosen: Callable[[Runner], bool]) -> int:
        """Unload every runner ``chosen`` picks, all at once; returns how many."""
        runners = [r for r in list(self.runners.values()) if chosen(r)]
        await asyncio.gather(*(self.unload(r) for r in runners))
        return len(runners)

    async def configure(self, model: StoredModel, backend_name: str | None, config: BackendConfig) -> Backend:
        """Set how ``model`` loads on a backend from now on (naming the backend also makes it the model's
        default); an idle loaded copy is unloaded so the next request uses the new settings."""
        backend = self.backend(backend_name, model)
        mine = [r for r in self.runners.values() if r.model.id == model.id and r.backend is backend]
        if any(r.in_use or not r.ready for r in mine):
            raise Conflict(f"model {str(model.name)!r} is in use; configure it when its requests are done "
                           f"(or unload it first)", code="runner_active")
        config = await self._adapters(model, config)
        self.configs[(model.id, backend.name)] = config
        if backend_name is not None:
            self.preferred_backend[model.id] = backend_name
        await asyncio.gather(*(self.unload(r) for r in mine))
        return backend

    def served_name(self, name: str, runner: Runner) -> str:
        """The model name a request to ``runner`` carries: a LoRA adapter's own (the backend selects it by
        that name), else the runner's model reference."""
        return name if name in self.lora_models else runner.model_ref

    async def _adapters(self, model: StoredModel, config: BackendConfig) -> BackendConfig:
        """Link the adapters' blobs into place now (a later garbage collection cannot take them) and make
        their names route to this model; a name that is a stored model's is refused."""
        from runlm.runner.lora import materialize

        for name in config.loras:
            owner = self.lora_models.get(name)
            if owner is not None and owner != str(model.name):
                raise BadRequest(f"LoRA adapter name {name!r} is already used by model {owner!r}", param="loras")
            try:
                await asyncio.to_thread(self.store.ensure, name)  # the store's own names, not the adapters'
            except (InvalidNameError, ModelNotFoundError):
                continue
            raise BadRequest(f"LoRA adapter name {name!r} is the name of a stored model", param="loras")
        try:
            paths = {n: str(await asyncio.to_thread(materialize, self.store.home, self.store.blobs, files))
                     for n, files in config.loras.items()}
        except ConfigError as exc:
            raise BadRequest(str(exc), param="loras") from None
        for name in [n for n, m in self.lora_models.items() if m == str(model.name)]:
            del self.lora_models[name]
        self.lora_models.update({n: str(model.name) for n in config.loras})
        return replace(config, lora_paths=paths)

    async def start(self) -> None:
        self._janitor = asyncio.create_task(self._expire_loop())
        self._health = asyncio.create_task(watch_health(self))

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            now = time.time()
            for r in list(self.runners.values()):
                if r.ready and not r.stopping and r.in_use == 0 and r.expires_at is not None and now >= r.expires_at:
                    await self.unload(r)

    async def close(self) -> None:
        for task in (self._janitor, self._health):
            if task:
                task.cancel()
        for task in list(self._loading.values()):
            task.cancel()
        await asyncio.gather(*(self.unload(r) for r in list(self.runners.values())), return_exceptions=True)
        with contextlib.suppress(OSError):
            for p in self._socket_dir.iterdir():
                p.unlink()
            self._socket_dir.rmdir()
