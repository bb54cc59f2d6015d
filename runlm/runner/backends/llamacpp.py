"""llama.cpp as a backend: a ``llama-server`` on PATH, or llama-cpp-python's server module."""
from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from runlm.runner.backends.base import (
    STATUS_NOT_INSTALLED,
    STATUS_RUNNING,
    BackendError,
    RequiredMemory,
    default_context,
    format_status,
)
from runlm.runner.backends.flags import is_float, is_int
from runlm.runner.backends.process import ProcessBackend, package_size
from runlm.runner.config import BackendConfig, BackendMode

if TYPE_CHECKING:
    from runlm.store import StoredModel

RUNTIME_OVERHEAD = 150 << 20


# SamplingParams field -> llama-server's flag for its default
_SAMPLING_FLAGS = {"temperature": "--temp", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
                   "repetition_penalty": "--repeat-penalty", "presence_penalty": "--presence-penalty",
                   "frequency_penalty": "--frequency-penalty", "max_tokens": "--n-predict",
                   "dry_multiplier": "--dry-multiplier", "dry_base": "--dry-base",
                   "dry_allowed_length": "--dry-allowed-length", "dry_penalty_last_n": "--dry-penalty-last-n"}


class LlamaCppBackend(ProcessBackend):
    name = "llamacpp"
    api_key_env = ("LLAMA_API_KEY", "API_KEY")  # llama-server; llama_cpp.server
    # flags both servers understand under these names (llama-server's spelling; see _python_argv)
    allowed_flags = {"--threads": is_int, "--batch-size": is_int, "--n-gpu-layers": is_int,
                     "--temp": is_float, "--parallel": is_int}

    @property
    def uses_tcp(self) -> bool:
        return True  # llama-cpp-python's server listens on TCP only

    @property
    def supports_speculative(self) -> bool:  # type: ignore[override]
        return self._binary() is not None  # llama-server takes a draft model; llama-cpp-python's server does not

    @property
    def health_path(self) -> str:
        # llama-server has /health; llama-cpp-python's server answers /v1/models once the model is loaded
        return "/health" if self._binary() else "/v1/models"

    def _binary(self) -> str | None:
        return shutil.which("llama-server")

    def _python_server(self) -> bool:
        # looked up without importing llama_cpp: that would load its ggml into this process
        spec = importlib.util.find_spec("llama_cpp")
        return spec is not None and any((Path(d) / "server" / "__main__.py").is_file()
                                        for d in spec.submodule_search_locations or ())

    def status(self) -> str:
        if self._installing:
            return self.install_status()
        if self._binary():
            return format_status(STATUS_RUNNING, f"llama-server at {self._binary()}")
        if self._python_server():
            import importlib.metadata

            return format_status(STATUS_RUNNING, f"llama-cpp-python {importlib.metadata.version('llama_cpp_python')}")
        if self._install_error:
            return self.install_status()
        return format_status(STATUS_NOT_INSTALLED, "no llama-server on PATH and no llama-cpp-python[server]; "
                                                   "run: runlm install-backend llamacpp")

    def disk_usage(self) -> int:
        return package_size("llama_cpp")

    async def install(self) -> None:
        if not self.installed():
            await self.pip_install("llama-cpp-python[server]")

    def required_memory(self, model: StoredModel, config: BackendConfig) -> RequiredMemory:
        kv = model.info.kv_bytes_per_token(2) * self.context_size(model, config)  # f16 KV cache
        return RequiredMemory(ram=model.size + kv + RUNTIME_OVERHEAD, vram=0)  # weights are mmapped as stored

    def command(self, address: str, model: str, model_ref: str, mode: BackendMode, config: BackendConfig,
                stored: StoredModel | None) -> list[str]:
        host, _, port = address.rpartition(":")
        ctx = str(self.context_size(stored, config) if stored else config.context_size or default_context())
        flags = self.check_flags(config.runtime_flags)
        binary = self._binary()
        if binary:
            argv = [binary, "-m", model, "--host", host, "--port", port, "--alias", model_ref, "-c", ctx]
            if mode is BackendMode.EMBEDDING:
                argv.append("--embedding")
            elif mode is BackendMode.RERANKING:
                argv.append("--reranking")
            if config.reasoning_budget is not None:
                argv += ["--reasoning-budget", str(config.reasoning_budget)]
            spec = config.speculative
            if spec is not None and spec.draft_model_path:
                argv += ["--model-draft", spec.draft_model_path, "--draft-max", str(spec.num_tokens),
                         "--draft-p-min", str(spec.min_acceptance_rate)]
            projector = stored.projector_path(model) if stored is not None else None
            if projector is not None and mode is BackendMode.COMPLETION:  # libmtmd: images in the chat
                argv += ["--mmproj", str(projector)]
            if stored is not None:  # the defaults the store knows the model recommends; runtime flags come later
                argv += [x for f, v in stored.info.sampling.items() if f in _SAMPLING_FLAGS
                         for x in (_SAMPLING_FLAGS[f], str(v))]
            return argv + flags
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", model, "--host", host, "--port", port,
                "--model_alias", model_ref, "--n_ctx", ctx]
        if mode is BackendMode.EMBEDDING:
            argv += ["--embedding", "true"]
        renames = {"--threads": "--n_threads", "--batch-size": "--n_batch", "--n-gpu-layers": "--n_gpu_layers"}
        return argv + [renames.get(f, f) for f in flags if f not in ("--temp", "--parallel")]

    async def run(self, socket: str, model: str, model_ref: str, mode: BackendMode, config: BackendConfig,
                  stored: StoredModel | None = None) -> None:
        if not self.installed():
            raise BackendError(self.status())
        await self.run_process(self.command(socket, model, model_ref, mode, config, stored), socket,
                               f"llamacpp-{model_ref.replace('/', '_').replace(':', '_')}-{mode.value}", config.gpu)
