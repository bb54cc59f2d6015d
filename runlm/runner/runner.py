"""One loaded model: a backend process for one (backend, model, mode) and the client that talks to it."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

from runlm.runner.backends.base import Backend, RequiredMemory
from runlm.runner.config import BackendConfig, BackendMode
from runlm.store import StoredModel

RunnerKey = tuple[str, str, BackendMode]  # backend name, model id, mode


def backend_client(address: str, uses_tcp: bool, api_key: str | None) -> httpx.AsyncClient:
    # generation streams can run for minutes: no read timeout, but a prompt connect timeout
    timeout = httpx.Timeout(None, connect=10.0)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None  # the daemon's own key for it
    if uses_tcp:
        return httpx.AsyncClient(base_url=f"http://{address}", timeout=timeout, headers=headers)
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=address), base_url="http://backend",
                             timeout=timeout, headers=headers)


def resident_bytes(pid: int | None) -> int | None:
    """What a backend process really holds in RAM now (VmRSS: its own memory plus the model file's
    mapped pages), or None where it cannot be read."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass(slots=True, eq=False)
class Runner:
    backend: Backend
    model: StoredModel
    mode: BackendMode
    config: BackendConfig
    address: str
    memory: RequiredMemory
    keep_alive: float
    client: httpx.AsyncClient
    task: asyncio.Task | None = None
    ready: bool = False
    dead: bool = False
    stopping: bool = False  # being unloaded: counted in memory until its process has exited
    error: str | None = None
    in_use: int = 0
    loaded_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    expires_at: float | None = None  # time.time() of the planned unload; None while in use or forever

    @property
    def key(self) -> RunnerKey:
        return (self.backend.name, self.model.id, self.mode)

    @property
    def model_ref(self) -> str:
        """The name the backend serves the model under."""
        return str(self.model.name)

    @property
    def pid(self) -> int | None:
        return self.backend.process_id(self.address)

    def to_json(self) -> dict:
        return {"backend_name": self.backend.name, "model_name": self.model_ref, "model_id": self.model.id,
                "mode": self.mode.value, "pid": self.pid, "in_use": self.in_use > 0, "ready": self.ready,
                "stopping": self.stopping,
                "loaded_at": int(self.loaded_at), "expires_at": int(self.expires_at) if self.expires_at else None,
                "keep_alive": self.keep_alive, "memory": {"ram": self.memory.ram, "vram": self.memory.vram,
                                                        "gpu": self.memory.gpu},
                "resident": resident_bytes(self.pid),
                "context_size": self.backend.context_size(self.model, self.config),
                "kv_cache_dtype": self.backend.kv_cache_dtype(self.config)}
