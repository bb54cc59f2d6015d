"""The tensor-parallel runners' kinds (runlm.engine.runners.select): the torch runner (TP) or the GPU runner
(GPU_TP: runlm.engine.runners.tp_gpu) split over ``tensor_parallel_size`` processes (runlm.engine.runners.tp_group).
One applies whenever more than one rank is asked for, and refuses by name what it does not split: it never falls
back to one process. Importing this module does not import torch; loading a model does."""
from __future__ import annotations

from typing import TYPE_CHECKING

from runlm.engine.runners.gpu_select import use_gpu_runner
from runlm.engine.runners.threads import set_torch_threads
from runlm.engine.types.config import EngineConfig, kv_cache_blocks
from runlm.models.spec import ModelSpec

if TYPE_CHECKING:
    from runlm.engine.core.kv_groups import AnyBlockManager
    from runlm.engine.runners.tp_gpu import GPUTPRunner
    from runlm.engine.runners.tp_group import TPLoaded
    from runlm.engine.runners.tp_runner import TPRunner
    from runlm.engine.structured.backend import StructuredOutputManager


class TPKind:
    name = "tensor-parallel torch"
    torch_free = False
    kv_cache_dtypes: tuple[str, ...] = ("auto",)

    def applies(self, config: EngineConfig) -> bool:
        return config.tensor_parallel_size > 1 and not use_gpu_runner(config)

    def why_not(self, spec: ModelSpec, config: EngineConfig) -> str | None:
        """None, or a ValueError naming what tensor parallelism does not run (it never hands over to one rank)."""
        reason = self.refuses(spec, config)
        if reason is not None:
            raise ValueError(f"tensor parallelism (tensor_parallel_size {config.tensor_parallel_size}) does not "
                             f"run {reason} yet; serve it with tensor_parallel_size 1")
        return None

    @staticmethod
    def refuses(spec: ModelSpec, config: EngineConfig) -> str | None:
        if config.device != "cpu":
            return f"on {config.device} with the torch runner (the GPU runner's ranks run there)"
        return TPKind.refuses_model(spec, config)

    @staticmethod
    def refuses_model(spec: ModelSpec, config: EngineConfig) -> str | None:
        from runlm.models.tp_shard import why_not_tp

        if spec.vision is not None or spec.projector is not None:
            return "images (a vision-language model)"
        return why_not_tp(spec.config, config.tensor_parallel_size) if spec.config is not None else None

    def load(self, spec: ModelSpec, config: EngineConfig) -> TPLoaded:
        from runlm.engine.runners.tp_group import TPLoaded, start_group

        group, loaded, split = start_group(config)
        return TPLoaded(loaded.model, loaded.config, loaded.tokenizer, loaded.path, loaded.vision, group=group,
                        split=split)

    def build(self, config: EngineConfig, loaded: TPLoaded, blocks: AnyBlockManager,
              structured: StructuredOutputManager) -> TPRunner:
        from runlm.engine.runners.tp_runner import TPRunner

        return TPRunner(config, loaded, blocks, structured)

    def kv_cache_blocks(self, config: EngineConfig, loaded: TPLoaded, bytes_per_token: int,
                        max_model_len: int) -> int:
        """The ranks' caches from one budget (kv_cache_memory: the ranks share the machine's memory), each its own
        KV heads' (a KV head kept by several ranks counts once for each)."""
        split = loaded.split
        assert split is not None
        kept = bytes_per_token * split.local_kv_heads * split.size // split.kv_heads
        return kv_cache_blocks(config, kept, max_model_len)

    def set_threads(self, n: int, loaded: TPLoaded) -> None:
        """Rank 0's share of the threads (each worker takes its own: tp_group.rank_threads)."""
        assert loaded.group is not None
        set_torch_threads(max(1, n // loaded.group.size))


class GPUTPKind(TPKind):
    """Tensor parallelism on the GPU runner: a rank a GPU (on CUDA), NCCL between them (gloo on CPUs)."""
    name = "tensor-parallel gpu"
    kv_cache_dtypes = ("auto", "fp8")

    def applies(self, config: EngineConfig) -> bool:
        return config.tensor_parallel_size > 1 and use_gpu_runner(config)

    @staticmethod
    def refuses(spec: ModelSpec, config: EngineConfig) -> str | None:
        size = config.tensor_parallel_size
        if config.device.startswith("cuda"):
            from runlm.sizes import gpu_memories

            first = int(config.device.partition(":")[2] or 0)
            gpus = len(gpu_memories() or [])
            if first + size > gpus:
                return f"{size} ranks from {config.device}: a rank a GPU, and the machine has {gpus}"
        if config.enable_lora:
            return "LoRA adapters on the GPU runner's ranks"
        if config.speculative_config is not None:
            return "speculative decoding on the GPU runner's ranks"
        if config.n_gpu_layers is not None and config.n_gpu_layers != -1:
            return "layer offload (--n-gpu-layers) beside it"
        return TPKind.refuses_model(spec, config)

    def build(self, config: EngineConfig, loaded: TPLoaded, blocks: AnyBlockManager,  # type: ignore[override]
              structured: StructuredOutputManager) -> GPUTPRunner:
        from runlm.engine.runners.tp_gpu import GPUTPRunner

        return GPUTPRunner(config, loaded, blocks, structured)

    def kv_cache_blocks(self, config: EngineConfig, loaded: TPLoaded, bytes_per_token: int,
                        max_model_len: int) -> int:
        """Each rank's from its own device's share (its own KV heads), the least of them."""
        from runlm.engine.runners.tp_gpu import rank_kv_cache_blocks

        assert loaded.group is not None and loaded.split is not None
        loaded.group.send(("profile", bytes_per_token, max_model_len))
        return rank_kv_cache_blocks(config, loaded, loaded.split, loaded.group.comm, bytes_per_token, max_model_len)


TP = TPKind()
GPU_TP = GPUTPKind()
