"""diffusers as a backend (mode image-generation): ``runlm.image_generation.serve`` in a child process on a Unix socket.

It serves a diffusers pipeline directory (``model_index.json``: whatever ``DiffusionPipeline`` loads)
over OpenAI's images API. diffusers is not one of runlm's own dependencies:
``runlm install-backend diffusers`` installs it (with transformers, which the pipelines' text
encoders come from) into runlm's environment.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from typing import TYPE_CHECKING

from runlm.runner.backends.base import STATUS_NOT_INSTALLED, STATUS_RUNNING, BackendError, RequiredMemory, format_status
from runlm.runner.backends.flags import is_int
from runlm.runner.backends.native import flag_value
from runlm.runner.backends.process import ProcessBackend, package_size
from runlm.runner.config import BackendConfig, BackendMode

if TYPE_CHECKING:
    from runlm.store import StoredModel

PACKAGES = ("diffusers", "transformers")  # import names, as pip installs them
INSTALL = ("diffusers>=0.42", "transformers>=5.0", "sentencepiece", "protobuf")  # T5 tokenizers (SD3, Flux)
# a Python process with torch, diffusers and transformers imported, before any weights
RUNTIME_OVERHEAD = 600 << 20
# room for the denoiser's and VAE decoder's activations, as a share of the weights: an allowance, not a
# measurement (they grow with the image size and n, which the loader does not know in advance)
ACTIVATION_SHARE = 0.5
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _is_device(v: str) -> bool:
    return v in ("cpu", "cuda") or v.startswith("cuda:") and v[5:].isdigit()


class DiffusersBackend(ProcessBackend):
    name = "diffusers"
    modes = (BackendMode.IMAGE_GENERATION,)
    allowed_flags = {"--device": _is_device, "--dtype": lambda v: v in DTYPE_BYTES, "--max-waiting": is_int,
                     "--max-side": is_int, "--threads": is_int}

    def status(self) -> str:
        if self._installing or self._install_error:
            return self.install_status()
        missing = [p for p in PACKAGES if importlib.util.find_spec(p) is None]
        if missing:
            return format_status(STATUS_NOT_INSTALLED, f"{' and '.join(missing)} not installed; "
                                                       f"run: runlm install-backend diffusers")
        return format_status(STATUS_RUNNING, f"diffusers {importlib.metadata.version('diffusers')}")

    def disk_usage(self) -> int:
        return package_size("diffusers")

    async def install(self) -> None:
        if not self.installed():
            await self.pip_install(*INSTALL)

    def check_config(self, config: BackendConfig) -> None:
        from runlm.runner.config import ConfigError

        super().check_config(config)
        if config.context_size is not None:
            raise ConfigError("context_size: an image-generation pipeline has no context to size")

    def required_memory(self, model: StoredModel, config: BackendConfig) -> RequiredMemory:
        """Weights at the dtype the process loads them in, their activations, and the Python runtime; on a GPU
        the weights and activations are in its memory instead."""
        device = flag_value(config.runtime_flags, "--device") or "cpu"
        dtype = flag_value(config.runtime_flags, "--dtype") or ("float32" if device == "cpu" else "float16")
        weights = model.info.parameters * DTYPE_BYTES[dtype]
        working = int(weights * (1 + ACTIVATION_SHARE))
        if device == "cpu":
            return RequiredMemory(ram=working + RUNTIME_OVERHEAD, vram=0)
        return RequiredMemory(ram=RUNTIME_OVERHEAD, vram=working)

    def context_size(self, model: StoredModel, config: BackendConfig) -> int:
        return 0

    def command(self, socket: str, model: str, model_ref: str, config: BackendConfig) -> list[str]:
        return [sys.executable, "-m", "runlm.image_generation.serve", model, "--uds", socket, "--served-model-name",
                model_ref, *self.check_flags(config.runtime_flags)]

    async def run(self, socket: str, model: str, model_ref: str, mode: BackendMode, config: BackendConfig,
                  stored: StoredModel | None = None) -> None:
        if not self.installed():
            raise BackendError(self.status())
        if mode not in self.modes:
            raise BackendError(f"the diffusers backend generates images; it cannot serve {mode.value}")
        await self.run_process(self.command(socket, model, model_ref, config), socket,
                               f"diffusers-{model_ref.replace('/', '_').replace(':', '_')}-{mode.value}", config.gpu)
