"""Backends the runner can start models with."""
from __future__ import annotations

from pathlib import Path

from runlm.runner.backends.base import Backend, BackendError, BackendExitedError, RequiredMemory
from runlm.runner.backends.diffusers import DiffusersBackend
from runlm.runner.backends.llamacpp import LlamaCppBackend
from runlm.runner.backends.native import NativeBackend
from runlm.runner.backends.vllm import VLLMBackend

DEFAULT_BACKEND = "native"
IMAGE_BACKEND = "diffusers"  # the default for image-generation models


def all_backends(log_dir: Path) -> dict[str, Backend]:
    backends: list[Backend] = [NativeBackend(log_dir), LlamaCppBackend(log_dir), VLLMBackend(log_dir),
                               DiffusersBackend(log_dir)]
    return {b.name: b for b in backends}


__all__ = ["Backend", "BackendError", "BackendExitedError", "DEFAULT_BACKEND", "IMAGE_BACKEND", "RequiredMemory",
           "all_backends"]
