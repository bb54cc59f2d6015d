"""Whether the engine runs on the GPU runner (runlm.engine.runners.gpu), and what it refuses there -- without
importing torch (the engine's bookkeeping stays torch-free until a runner is built)."""
from __future__ import annotations

import os

from runlm.engine.types.config import EngineConfig
from runlm.models import families
from runlm.models.spec import ModelSpec

GPU_RUNNER_ENV = "RUNLM_GPU_RUNNER"  # "1": the GPU runner on any device (tests and benchmarks on a CPU)


def use_gpu_runner(config: EngineConfig) -> bool:
    """A CUDA device (``cuda``, ``cuda:1``), or RUNLM_GPU_RUNNER=1 (on a CPU: the same runner, eager, with the
    reference attention -- how the CPU tests prove it). RUNLM_GPU_RUNNER=0 keeps CUDA on the torch runner."""
    flag = os.environ.get(GPU_RUNNER_ENV)
    if flag is not None and flag != "":
        return flag == "1"
    return config.device.startswith("cuda")


def why_not_gpu(config: EngineConfig) -> str | None:
    """What the engine asks for that the GPU runner does not run yet (refused by name, never a slow fallback)."""
    reasons = [(config.mmproj is not None, "images (a vision projector)")]
    return next((what for bad, what in reasons if bad), None)


def why_not_gpu_model(spec: ModelSpec) -> str | None:
    """What in the model the GPU runner does not run yet: images, or what its family declares (runlm.models.families:
    mixtures of experts)."""
    if spec.vision is not None and spec.projector is None:
        return "images (a vision-language model)"
    if spec.config is None:
        return None
    return families.get(spec.config.family).gpu_refuses


def check_gpu(config: EngineConfig) -> None:
    reason = why_not_gpu(config)
    if reason is not None:
        raise ValueError(f"the GPU runner does not run {reason} yet; run this model with --device cpu (or set "
                         f"{GPU_RUNNER_ENV}=0 for the torch runner on the GPU)")

