"""Engine settings and the KV-cache budget."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runlm.dtypes import DTYPE_BYTES, dtype_itemsize, torch_dtype
from runlm.engine.types.spec_config import SpeculativeConfig
from runlm.kv_size import check_kv_cache_dtype
from runlm.sizes import available_memory, parse_size

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_KV_CAP", "DEFAULT_KV_FRACTION", "EngineConfig", "available_memory", "dtype_itemsize",
           "kv_cache_blocks", "parse_size", "physical_cores", "torch_dtype"]

def physical_cores() -> int:
    """Physical CPU cores (hyper-threads share one core's SIMD units, so kernels gain nothing from them)."""
    try:
        with open("/proc/cpuinfo") as f:
            cores = {(p, c) for p, c in re.findall(r"physical id\s*:\s*(\d+)[\s\S]*?core id\s*:\s*(\d+)", f.read())}
        if cores:
            return len(cores)
    except OSError:
        pass
    return max(1, (os.cpu_count() or 2) // 2)


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """Built once (by the CLI or LLM/AsyncLLM) and passed down unchanged; ``model`` is a resolved path."""
    model: str
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    # bytes ('2GiB', 1<<30) or a fraction of currently available memory (0 < x <= 1)
    kv_cache_memory: int | float | str | None = None
    enable_prefix_caching: bool = True
    # the KV cache's storage (vLLM's --kv-cache-dtype): "auto" (the compute dtype) or "q8_0" (llama.cpp's 8-bit
    # blocks, the native runner only; runlm.kv_size)
    kv_cache_dtype: str = "auto"
    # a torch.dtype, or its name: the common names stay strings so a config needs no torch (see torch_dtype)
    dtype: torch.dtype | str = "float32"
    device: str = "cpu"
    seed: int = 0
    # what the model is run for: "auto" (from its files), "generate", "embed" or "score" (vLLM's runner/convert)
    task: str = "auto"
    # reference numerics (dequantized weights x fp32 activations) instead of GGUF blocks x 8-bit activations
    exact_numerics: bool = False
    # CPU threads for the kernels (None: one per physical core)
    threads: int | None = None
    # LoRA (vLLM's names): adapters in one step, their largest rank, adapters kept loaded (None: max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # speculative decoding (vLLM's speculative_config; a dict is accepted and checked here)
    speculative_config: SpeculativeConfig | None = None
    # images: llama.cpp's projector file beside a text GGUF (--mmproj), and the most images one request may
    # bring (vLLM's limit_mm_per_prompt: {"image": N}, or N)
    mmproj: str | None = None
    limit_mm_per_prompt: dict[str, int] | int = 16
    # a GPU (vLLM's names): the share of the device's memory runlm may use (weights, activations, then the KV
    # cache gets what a profiled largest step leaves), and whether to run steps eagerly (no CUDA graphs)
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    # async scheduling (vLLM's name): the GPU runner queues step N+1 while step N runs, and reads N's tokens
    # while N+1 computes (runlm.engine.core.overlap); off: every step is waited for before the next is scheduled
    async_scheduling: bool = True
    # tensor parallelism (vLLM's name): the model split over this many processes (runlm.engine.runners.tp_group)
    tensor_parallel_size: int = 1
    # layer offload (llama.cpp's --n-gpu-layers): the GPU runner keeps this many of the model's last decoder
    # layers on the GPU and runs the others on the CPU (None: all that fit, after what free memory allows; -1: all)
    n_gpu_layers: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.coerce(self.speculative_config))
        if not (isinstance(self.dtype, str) and self.dtype in DTYPE_BYTES):
            object.__setattr__(self, "dtype", torch_dtype(self.dtype))  # a rarer name, checked by torch
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.task not in ("auto", "generate", "embed", "score"):
            raise ValueError(f"task must be auto, generate, embed or score, not {self.task!r}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.block_size < 1:
            raise ValueError("block_size must be at least 1")
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be at least 1")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be at least 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be at least max_loras")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be a whole number of processes (1 or more)")
        if self.n_gpu_layers is not None and (not isinstance(self.n_gpu_layers, int) or self.n_gpu_layers < -1
                                              or self.n_gpu_layers == 0):
            raise ValueError("n_gpu_layers must be a number of layers (1 or more), or -1 for all of them; a model "
                             "with none on the GPU runs there with --device cpu")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be a fraction in (0, 1]")
        limit = self.limit_mm_per_prompt
        if isinstance(limit, dict):
            unknown = [k for k in limit if k != "image"]
            if unknown:
                raise ValueError(f"limit_mm_per_prompt: runlm takes images only, not {unknown[0]!r}")
            limit = limit.get("image", 16)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError("limit_mm_per_prompt must be a whole number of images (0 or more)")
        object.__setattr__(self, "limit_mm_per_prompt", limit)

    @property
    def image_limit(self) -> int:
        limit = self.limit_mm_per_prompt
        return limit if isinstance(limit, int) else limit.get("image", 16)


DEFAULT_KV_FRACTION = 0.25
DEFAULT_KV_CAP = 4 << 30


def cache_budget(config: EngineConfig) -> int:
    """The bytes kv_cache_memory gives a cache. Default: a quarter of free memory, at most 4 GiB."""
    spec = config.kv_cache_memory
    if spec is None:
        return min(int(available_memory() * DEFAULT_KV_FRACTION), DEFAULT_KV_CAP)
    if isinstance(spec, float) and 0 < spec <= 1:
        return int(available_memory() * spec)
    return parse_size(spec)


def kv_cache_blocks(config: EngineConfig, bytes_per_token: int, max_model_len: int) -> int:
    """How many blocks the budget buys (cache_budget; by default no more than every sequence at full context would
    use)."""
    spec = config.kv_cache_memory
    budget = cache_budget(config)
    if spec is None:
        budget = min(budget, bytes_per_token * max_model_len * config.max_num_seqs)
    blocks = budget // (bytes_per_token * config.block_size)
    if blocks < 1:
        raise ValueError(f"kv_cache_memory {spec!r} is too small for one block of {config.block_size} tokens "
                         f"({bytes_per_token * config.block_size} bytes)")
    return int(blocks)


def state_slots(config: EngineConfig, bytes_per_seq: int) -> int:
    """How many sequences' recurrent states (runlm.models.mamba2) the budget holds beside the KV cache: one per
    running sequence up to max_num_seqs, fewer where a state is large (more sequences then wait their turn)."""
    slots = min(config.max_num_seqs, cache_budget(config) // max(bytes_per_seq, 1))
    if slots < 1:
        raise ValueError(f"kv_cache_memory {config.kv_cache_memory!r} is too small for one sequence's recurrent "
                         f"state ({bytes_per_seq} bytes)")
    return int(slots)


