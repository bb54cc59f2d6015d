"""The GPU runner's side of layer offload (runlm.models.offload): where a model's first layers run on the CPU, their
K/V live in a cache on the host (float32, the CPU layers' compute dtype) beside the device's, both addressed by
the step's one set of blocks; ``OffloadBackend`` hands each layer to the backend that holds its cache.

How many layers go to the GPU (``gpu_split``): the user's ``n_gpu_layers``, or on CUDA as many of the last layers
as fit the device's free share beside the embedding, the head, a reserve for one step's activations and each
layer's K/V for one sequence of max_model_len (Ollama's automatic split). A model that fits whole is not split.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from runlm.dtypes import torch_dtype
from runlm.engine.types.config import EngineConfig
from runlm.kernels.triton.backend import PagedAttentionBackend
from runlm.kv_size import kv_cache_bytes_per_token
from runlm.models.offload import HOST, HOST_DTYPE, LayerSplit, plan_split, weight_bytes_on_device

if TYPE_CHECKING:
    from runlm.models.config import ModelConfig
    from runlm.models.spec import ModelSpec

log = logging.getLogger("runlm.gpu")

ACTIVATION_RESERVE = 1 << 30  # a step's activations and logits on the device, beside the weights and the cache


def gpu_split(spec: ModelSpec, config: EngineConfig, kept_types: Sequence[str]) -> LayerSplit | None:
    """The layer split the GPU runner loads ``spec`` with (None: whole on the device); refused with LoRA."""
    device = torch.device(config.device)
    cfg = spec.decoder_config()
    itemsize = torch.empty(0, dtype=torch_dtype(config.dtype)).element_size()
    room = None
    if device.type == "cuda" and config.n_gpu_layers is None:
        free, total = torch.cuda.mem_get_info(device)
        room = int(config.gpu_memory_utilization * total) - (total - free) - ACTIVATION_RESERVE
    heads, k_dim, v_dim = cfg.kv_cache_shape
    kv_per_layer = kv_cache_bytes_per_token(1, heads, k_dim, "auto", itemsize, v_dim) * \
        cfg.context_length(config.max_model_len)
    split = plan_split(spec, config.n_gpu_layers, weight_bytes_on_device(spec, itemsize, kept_types), room,
                       kv_per_layer)
    if split is not None and config.enable_lora:
        raise ValueError(f"{spec.path.name}: LoRA adapters live in GPU slots, which layer offload's CPU layers do not "
                         f"read; serve it with all {split.num_layers} layers on the GPU (--n-gpu-layers -1) or "
                         f"without adapters")
    if split is not None and config.tensor_parallel_size > 1:
        raise ValueError("layer offload and tensor parallelism are not combined: choose --n-gpu-layers or "
                         "--tensor-parallel-size")
    return split


def host_kv_layers(mc: ModelConfig, split: LayerSplit) -> list[int]:
    return [layer for layer in mc.kv_layers if layer < split.host_layers]


def device_kv_bytes_per_token(mc: ModelConfig, split: LayerSplit, bytes_per_token: int, itemsize: int) -> int:
    """Of the engine's KV bytes per token (every layer's in the compute dtype, a draft's too), the device's."""
    heads, k_dim, v_dim = mc.kv_cache_shape
    return bytes_per_token - kv_cache_bytes_per_token(len(host_kv_layers(mc, split)), heads, k_dim, "auto", itemsize,
                                                      v_dim)


def host_kv_bytes_per_token(mc: ModelConfig, split: LayerSplit) -> int:
    heads, k_dim, v_dim = mc.kv_cache_shape
    return kv_cache_bytes_per_token(len(host_kv_layers(mc, split)), heads, k_dim, "auto", HOST_DTYPE.itemsize, v_dim)


class OffloadBackend:
    """Two PagedAttentionBackends, one on the device for the GPU layers and one on the host for the CPU layers,
    seen as one: ``forward`` / ``rope_forward`` / ``context_kv`` go to the layer's. The runner sets each one's step
    (the host's from the packed host array: nothing is read back from the device)."""
    graphable = False  # (the step crosses to the host and back)

    def __init__(self, device: PagedAttentionBackend, host: PagedAttentionBackend, host_layers: int) -> None:
        self.device, self.host, self.host_layers = device, host, host_layers
        self.use_triton = device.use_triton  # (the CPU layers' RoPE copies are not sync-free: never fused there)

    def of(self, layer: int) -> PagedAttentionBackend:
        return self.host if layer < self.host_layers else self.device

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                window: int | None, softcap: float | None, sinks: torch.Tensor | None = None,
                chunk: int | None = None) -> torch.Tensor:
        return self.of(layer).forward(layer, q, k, v, scale, window, softcap, sinks, chunk)

    def rope_forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, scale: float, window: int | None,
                     softcap: float | None, norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                     sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
        return self.of(layer).rope_forward(layer, q, k, v, positions, cos, sin, interleaved, scale, window, softcap,
                                           norms, sinks, chunk)

    def context_kv(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.of(layer).context_kv(layer, seq)

    def flat_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        host, device = self.host.flat_caches(), self.device.flat_caches()
        return host[:self.host_layers] + device[self.host_layers:]

    def set_host_step(self, table: np.ndarray, cu: np.ndarray, lens: np.ndarray, slots: np.ndarray,
                      groups: Sequence[tuple[np.ndarray, np.ndarray]], max_query_len: int | None) -> None:
        self.host.set_step(table, cu, lens, slots, groups=groups, max_query_len=max_query_len)


def offload_backend(mc: ModelConfig, split: LayerSplit, num_blocks: int | list[int], block_size: int,
                    dtype: torch.dtype, device: torch.device, max_seqs: int, max_tokens: int, max_blocks: int,
                    layer_group: list[int] | None) -> OffloadBackend:
    """The device's cache for the GPU layers and the host's for the CPU layers, the same blocks each."""
    heads, k_dim, v_dim = mc.kv_cache_shape
    host_layers = host_kv_layers(mc, split)

    def backend(on: torch.device, kind: torch.dtype, layers: list[int], use_triton: bool | None
                ) -> PagedAttentionBackend:
        return PagedAttentionBackend(mc.num_layers, num_blocks, block_size, heads, k_dim, kind, on, max_seqs,
                                     max_tokens, max_blocks, kv_layers=layers, latent=v_dim == 0,
                                     layer_group=layer_group, use_triton=use_triton)

    return OffloadBackend(backend(device, dtype, [x for x in mc.kv_layers if x >= split.host_layers], None),
                          backend(HOST, HOST_DTYPE, host_layers, False), split.host_layers)
