"""Whether the engine runs on the GPU runner (runlm.engine.runners.gpu), and what it refuses there -- without
importing torch (the engine's bookkeeping stays torch-free until a runner is built)."""
from __future__ import annotations

import os

from runlm.engine.types.config import EngineConfig
from runlm.models import families
from runlm.models.spec import ModelSpec
from runlm.models.vision import TEXT_MODEL_NEEDS

# what of TEXT_MODEL_NEEDS its attention does: Gemma 3's bidirectional image spans (those rows computed again with
# their mask, runlm.models.attention.redo_bidirectional, over the backend's cache)
GPU_MEETS = ("gemma3",)
GPU_RUNNER_ENV = "RUNLM_GPU_RUNNER"  # "1": the GPU runner on any device (tests and benchmarks on a CPU)


def use_gpu_runner(config: EngineConfig) -> bool:
    """A CUDA device (``cuda``, ``cuda:1``), or RUNLM_GPU_RUNNER=1 (on a CPU: the same runner, eager, with the
    reference attention -- how the CPU tests prove it). RUNLM_GPU_RUNNER=0 keeps CUDA on the torch runner."""
    flag = os.environ.get(GPU_RUNNER_ENV)
    if flag is not None and flag != "":
        return flag == "1"
    return config.device.startswith("cuda")


def why_not_gpu_model(spec: ModelSpec) -> str | None:
    """What in the model the GPU runner does not run yet: images whose text model needs what its attention backend
    does not do (Qwen2.5-VL's M-RoPE positions, Gemma 3's bidirectional image spans), or what its family declares
    (runlm.models.families: latent attention, sinks, recurrent layers...)."""
    need = TEXT_MODEL_NEEDS.get(spec.vision) if spec.vision not in (None, *GPU_MEETS) else None
    if need is not None:
        return f"images for a text model that needs {need} ({spec.vision})"
    if spec.config is None:
        return None
    return families.get(spec.config.family).gpu_refuses


