"""The contract between the runner and a backend (after Docker Model Runner's ``inference.Backend``).

A backend serves one model, in one mode, with an OpenAI-compatible API on a Unix socket (or
a TCP address when ``uses_tcp``). ``run`` is one-shot: it returns (or raises) when its
process dies or when it is cancelled, and never restarts anything itself; the runner decides.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runlm.runner.config import BackendConfig, BackendMode

if TYPE_CHECKING:
    from runlm.store import StoredModel

DEFAULT_CONTEXT = 4096  # Docker Model Runner's default context size
CONTEXT_ENV = ("RUNLM_CONTEXT_LENGTH", "OLLAMA_CONTEXT_LENGTH")  # the daemon's default, as Ollama's server reads it


def default_context() -> int:
    """The context a model loads with when nothing sets one: $RUNLM_CONTEXT_LENGTH, else
    $OLLAMA_CONTEXT_LENGTH, else 4096. A value that is not an integer of at least 16 is a ValueError naming it."""
    import os

    for name in CONTEXT_ENV:
        text = os.environ.get(name, "").strip()
        if text:
            if not text.isdigit() or int(text) < 16:
                raise ValueError(f"${name}={text!r}: the default context length must be an integer of at least 16")
            return int(text)
    return DEFAULT_CONTEXT
STATUS_RUNNING = "Running"
STATUS_ERROR = "Error"
STATUS_NOT_INSTALLED = "Not Installed"
STATUS_INSTALLING = "Installing"


def format_status(kind: str, details: str = "") -> str:
    return f"{kind}: {details}" if details else kind


class BackendError(RuntimeError):
    """The backend cannot do what was asked (not installed, bad flag, its process died)."""


class BackendExitedError(BackendError):
    """The backend's process ended on its own; ``log_tail`` says why, when it said anything."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message + (f"\n{log_tail}" if log_tail else ""))
        self.log_tail = log_tail


@dataclass(slots=True, frozen=True)
class RequiredMemory:
    ram: int   # bytes
    vram: int  # bytes, on one GPU
    gpu: int | None = None  # which (the driver's index), once the loader has placed it (None: not placed)

    def __add__(self, other: RequiredMemory) -> RequiredMemory:
        return RequiredMemory(self.ram + other.ram, self.vram + other.vram)


class Backend(abc.ABC):
    name: str  # lowercase, usable in a URL path and a socket file name
    # what the backend can serve a model for
    modes: tuple[BackendMode, ...] = (BackendMode.COMPLETION, BackendMode.EMBEDDING, BackendMode.RERANKING)

    @property
    def uses_external_model_management(self) -> bool:
        """True when the backend fetches models itself instead of reading them from our store."""
        return False

    @property
    def health_path(self) -> str:
        """GET path that answers 200 once the model is loaded (the loader polls it)."""
        return "/health"

    def api_key_for(self, address: str) -> str | None:
        """The key the daemon sends to the backend at ``address`` (None: it takes none)."""
        return None

    @property
    def uses_tcp(self) -> bool:
        """True when ``run`` gets a 'host:port' address instead of a Unix socket path."""
        return False

    @abc.abstractmethod
    async def install(self) -> None:
        """Make the backend usable; a no-op when it already is. Raises BackendError if it cannot."""

    @abc.abstractmethod
    async def run(self, socket: str, model: str, model_ref: str, mode: BackendMode, config: BackendConfig,
                  stored: StoredModel | None = None) -> None:
        """Serve ``model`` (a path from the store) as ``model_ref`` on ``socket`` until cancelled or dead.

        ``stored`` is the store's record of the model (its metadata sizes the KV cache) when the
        runner manages models; a backend with external model management gets None.

        Returns None only when cancelled; raises BackendExitedError when the process ends by itself.
        Every process it started has ended by the time it returns.
        """

    @abc.abstractmethod
    def status(self) -> str:
        """'Running: <details>', 'Error: <details>', 'Not Installed: <details>' or 'Installing: <details>'."""

    @abc.abstractmethod
    def disk_usage(self) -> int:
        """Bytes the backend's own installation takes (not counting models)."""

    @abc.abstractmethod
    def required_memory(self, model: StoredModel, config: BackendConfig) -> RequiredMemory:
        """Memory a process serving ``model`` with ``config`` will need: weights + KV cache + runtime."""

    def kv_cache_dtype(self, config: BackendConfig) -> str | None:
        """The KV cache's storage the backend will use (--kv-cache-dtype's names), None where it does not say."""
        return None

    def context_size(self, model: StoredModel, config: BackendConfig) -> int:
        """The context length the backend will run ``model`` with: the configured (or asked: num_ctx) one, else the
        model's Modelfile's PARAMETER num_ctx, else the daemon's default; never past the model's own."""
        default = (model.manifest.get("modelfile") or {}).get("num_ctx") or default_context()
        return min(config.context_size or default, model.info.context_length or default)

    supports_speculative = False
    supports_lora = False
    takes_chat_template = False

    def check_config(self, config: BackendConfig) -> None:
        """Raise ConfigError for settings this backend cannot honour (rather than silently ignoring them)."""
        from runlm.runner.config import ConfigError

        self.check_flags(config.runtime_flags)
        if config.speculative is not None and not self.supports_speculative:
            raise ConfigError(f"speculative: the {self.name} backend does not support a draft model")
        if config.loras and not self.supports_lora:
            raise ConfigError(f"loras: the {self.name} backend does not serve LoRA adapters (the native one does)")
        if config.chat_template is not None and not self.takes_chat_template:
            raise ConfigError(f"chat_template: the {self.name} backend does not take one (the native one does)")

    def check_flags(self, flags: list[str]) -> list[str]:
        """The runtime flags this backend accepts, validated; raises ConfigError for any other."""
        from runlm.runner.backends.flags import validate_flags

        return validate_flags(self.name, getattr(self, "allowed_flags", {}), flags)

    def process_id(self, socket: str) -> int | None:
        """The pid serving ``socket``, when the backend runs one process per model."""
        return None

    def installed(self) -> bool:
        return self.status().startswith(STATUS_RUNNING)
