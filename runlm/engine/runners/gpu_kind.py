"""The GPU runner's kind (runlm.engine.runners.select): CUDA, or RUNLM_GPU_RUNNER=1 on any device. Importing this
module does not import torch; loading a model does."""
from __future__ import annotations

from typing import TYPE_CHECKING

from runlm.engine.runners.gpu_select import keep_gguf_blocks, use_gpu_runner
from runlm.engine.runners.threads import set_torch_threads
from runlm.engine.types.config import EngineConfig
from runlm.models.spec import ModelSpec

if TYPE_CHECKING:
    from runlm.engine.core.kv_groups import AnyBlockManager
    from runlm.engine.runners.gpu import GPURunner
    from runlm.engine.structured.backend import StructuredOutputManager
    from runlm.models.load import LoadedModel


class GPUKind:
    """The GPU runner (runlm.engine.runners.gpu): weights straight to the device in their stored dtype."""
    name = "gpu"
    torch_free = False
    kv_cache_dtypes = ("auto", "fp8")  # (fp8: float8 e4m3, runlm.kernels.triton.kv_store)

    def applies(self, config: EngineConfig) -> bool:
        return use_gpu_runner(config)

    def why_not(self, spec: ModelSpec, config: EngineConfig) -> str | None:
        """None: it runs every family the torch runner does (latent attention, sinks, chunks, recurrent layers,
        images...), so a GPU user is never moved to a slow runner."""
        return None

    def load(self, spec: ModelSpec, config: EngineConfig) -> LoadedModel:
        from runlm.engine.runners.gpu_offload import gpu_split
        from runlm.models.gpu_blocks import KEPT_TYPES
        from runlm.models.gpu_load import load_to_device

        blocks = keep_gguf_blocks()
        return load_to_device(spec, dtype=config.dtype, device=config.device,
                              gpu_memory_utilization=config.gpu_memory_utilization, gguf_blocks=blocks,
                              split=gpu_split(spec, config, sorted(KEPT_TYPES) if blocks else []))

    def build(self, config: EngineConfig, loaded: LoadedModel, blocks: AnyBlockManager,
              structured: StructuredOutputManager) -> GPURunner:
        from runlm.engine.runners.gpu import GPURunner

        return GPURunner(config, loaded, blocks, structured)

    def kv_cache_blocks(self, config: EngineConfig, loaded: LoadedModel, bytes_per_token: int,
                        max_model_len: int) -> int:
        """What a profiled largest step leaves of gpu_memory_utilization (on a CPU: kv_cache_memory)."""
        from runlm.engine.runners.gpu import gpu_kv_cache_blocks

        return gpu_kv_cache_blocks(config, loaded, bytes_per_token, max_model_len)

    def set_threads(self, n: int, loaded: object) -> None:
        set_torch_threads(n)


GPU = GPUKind()
