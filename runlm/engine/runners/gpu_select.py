"""Whether the engine runs on the GPU runner (runlm.engine.runners.gpu), and how it keeps a GGUF's matrices --
without importing torch (the engine's bookkeeping stays torch-free until a runner is built)."""
from __future__ import annotations

import os

from runlm.engine.types.config import EngineConfig

GPU_RUNNER_ENV = "RUNLM_GPU_RUNNER"  # "1": the GPU runner on any device (tests and benchmarks on a CPU)
GGUF_DENSE_ENV = "RUNLM_GPU_GGUF_DENSE"  # "1": a GGUF's matrices dequantized to the compute dtype at load


def keep_gguf_blocks() -> bool:
    """Whether the GPU runner keeps a GGUF's matrices in their blocks (the default), or dequantizes them at load
    (RUNLM_GPU_GGUF_DENSE=1: the fallback to measure against, and to use where a GPU's prefill is faster dense)."""
    return os.environ.get(GGUF_DENSE_ENV) != "1"


def use_gpu_runner(config: EngineConfig) -> bool:
    """A CUDA device (``cuda``, ``cuda:1``), or RUNLM_GPU_RUNNER=1 (on a CPU: the same runner, eager, with the
    reference attention -- how the CPU tests prove it). RUNLM_GPU_RUNNER=0 keeps CUDA on the torch runner."""
    flag = os.environ.get(GPU_RUNNER_ENV)
    if flag is not None and flag != "":
        return flag == "1"
    return config.device.startswith("cuda")
