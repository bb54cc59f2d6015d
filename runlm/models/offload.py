"""Layer offload (llama.cpp's ``--n-gpu-layers``): a model bigger than its GPU share keeps its last K decoder
layers, the token embedding, the final norm and the output head on the GPU, and runs its first layers on the
CPU -- one step across both, the hidden rows crossing twice (to the host before the first CPU layer, back after
the last).

- Which layers (as llama.cpp counts them): the last K, so the output head and the sampler stay on the GPU and
  nothing but [tokens, hidden] rows ever crosses. ``gpu_layers_that_fit`` picks K from the device's free memory
  when it is not given (Ollama's automatic split); a model that fits whole is never split.
- The CPU layers compute in float32 on runlm's CPU kernels: a GGUF's matrices stay in their blocks as mapped from
  the file and are multiplied with 8-bit activations (runlm.models.linear.Linear.keep_ggml, the native runner's
  kernels), other matrices are dense float32. Their RoPE tables are their own copies on the host.
- Each CPU layer's K/V lives in a CPU cache of its own (the GPU runner's OffloadBackend), addressed by the same
  blocks as the GPU layers' caches.

Not split: models with recurrent layers (their per-sequence states live on the device) and LoRA adapters (their
slots are on the device); both are refused by name.
"""
from __future__ import annotations

import copy
import logging
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from math import prod
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from runlm.models.spec import ModelSpec

log = logging.getLogger("runlm.gpu")

HOST = torch.device("cpu")
HOST_DTYPE = torch.float32
_LAYER = re.compile(r"(?:^|\.)(?:blk|layers)\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The decoder layer a weight belongs to, by its HF name (model.layers.N.) or GGUF name (blk.N.)."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True, slots=True)
class LayerSplit:
    """Layers 0 .. host_layers - 1 on the CPU, the rest on the device."""
    num_layers: int
    host_layers: int
    host_bytes: int = 0  # the CPU layers' weights as held
    device_bytes: int = 0  # everything else's, on the device

    @property
    def gpu_layers(self) -> int:
        return self.num_layers - self.host_layers

    def on_host(self, name: str) -> bool:
        layer = layer_of(name)
        return layer is not None and layer < self.host_layers

    def describe(self) -> str:
        return (f"layers 0-{self.host_layers - 1} on the CPU ({self.host_bytes / 2**30:.2f} GiB), "
                f"{self.host_layers}-{self.num_layers - 1} with the embedding and the head on the GPU "
                f"({self.device_bytes / 2**30:.2f} GiB)")


def weight_bytes_on_device(spec: ModelSpec, itemsize: int, kept_types: Iterable[str]) -> dict[str, int]:
    """Each stored tensor's bytes on the GPU runner's device: a GGUF matrix of a type kept in its blocks as stored,
    a float as ``itemsize`` per value, a pre-quantized checkpoint's packed tensors as stored."""
    kept = frozenset(kept_types)
    if spec.gguf is not None:
        return {name: i.n_bytes if i.qtype in kept and len(i.shape) in (2, 3) else i.n_values * itemsize
                for name, i in spec.gguf.tensors.items()}
    return {name: prod(t.shape) * itemsize if t.qtype in ("F32", "F16", "BF16") else t.end - t.begin
            for name, t in spec.safetensors().tensors.items()}


def gpu_layers_that_fit(layer_bytes: list[int], fixed_bytes: int, kv_bytes_per_layer: int, room: int) -> int:
    """The most of a model's last layers that fit ``room`` bytes of the device beside ``fixed_bytes`` (the
    embedding, the head: always there), each with its weights and ``kv_bytes_per_layer`` of KV cache."""
    left = room - fixed_bytes
    k = 0
    for size in reversed(layer_bytes):
        left -= size + kv_bytes_per_layer
        if left < 0:
            break
        k += 1
    return k


def plan_split(spec: ModelSpec, n_gpu_layers: int | None, sizes: Mapping[str, int], room: int | None,
               kv_bytes_per_layer: int) -> LayerSplit | None:
    """How a model is split (None: not at all). ``n_gpu_layers``: the user's K (-1 or None with ``room`` None:
    all); else as many as fit ``room`` bytes (None on a CPU). Refused: a model that fits no layer, and what a
    split cannot hold (recurrent layers)."""
    cfg = spec.decoder_config()
    n = cfg.num_layers
    per_layer = [0] * n
    fixed = 0
    for name, size in sizes.items():
        layer = layer_of(name)
        if layer is not None and layer < n:
            per_layer[layer] += size
        elif layer is None:
            fixed += size
    if n_gpu_layers is None or n_gpu_layers == -1:
        if room is None or n_gpu_layers == -1:
            return None
        k = gpu_layers_that_fit(per_layer, fixed, kv_bytes_per_layer, room)
        if k < 1:
            raise ValueError(f"{spec.path.name}: not one of its {n} layers fits the GPU: the embedding and head take "
                             f"{fixed / 2**30:.2f} GiB and a layer {max(per_layer) / 2**30:.2f} GiB with its KV cache "
                             f"{kv_bytes_per_layer / 2**30:.2f} GiB, of {max(room, 0) / 2**30:.2f} GiB free for "
                             f"runlm; run it with --device cpu, or raise --gpu-memory-utilization")
    else:
        k = n_gpu_layers
    if k >= n:
        return None
    if cfg.recurrent_layers:
        raise ValueError(f"{spec.path.name}: layer offload does not split the {cfg.family} family's recurrent layers "
                         f"(their per-sequence states live on the GPU); it needs {n} layers on the GPU or "
                         f"--device cpu")
    host = n - k
    return LayerSplit(n, host, sum(per_layer[:host]), fixed + sum(per_layer[host:]))


@dataclass(slots=True)
class _Crossing:
    """What one model's CPU layers share within a step: the positions copied to the host once; ``skip`` while the
    GPU's memory is profiled (host_layers_skipped)."""
    device: torch.device
    dtype: torch.dtype
    positions: tuple[torch.Tensor, torch.Tensor] | None = field(default=None)  # (device tensor, its host copy)
    skip: bool = False

    def host_positions(self, positions: torch.Tensor) -> torch.Tensor:
        if positions.device == HOST:
            return positions
        if self.positions is None or self.positions[0] is not positions:
            self.positions = (positions, positions.to(HOST))
        return self.positions[1]


def host_ropes(layers: Iterable[nn.Module]) -> None:
    """The CPU layers' RoPE tables as their own host copies (the model's are moved to the device for the GPU
    layers' sync-free lookups); ``on_host`` keeps the GPU runner from moving them."""
    from runlm.models.rope import RotaryEmbedding

    copies: dict[int, RotaryEmbedding] = {}
    for layer in layers:
        for module in layer.modules():
            for name, child in list(module.named_children()):
                if isinstance(child, RotaryEmbedding):
                    if id(child) not in copies:
                        copies[id(child)] = twin = copy.deepcopy(child)
                        twin.on_host = True
                    setattr(module, name, copies[id(child)])


def offload_layers(model: Any, split: LayerSplit, device: torch.device, dtype: torch.dtype) -> None:
    """Run ``model``'s first ``split.host_layers`` decoder layers (already on the host, float32) on the CPU: their
    inputs cross to the host before the first of them and the last one's output back to ``device``/``dtype``."""
    inner = model.model
    crossing = _Crossing(device, dtype)
    layers = [inner.layers[i] for i in range(split.host_layers)]
    host_ropes(layers)

    def to_host(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        positions, x, *rest = args
        return (crossing.host_positions(positions), x.to(HOST, HOST_DTYPE), *rest)

    def to_device(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        return out.to(device, dtype)

    for layer in layers:
        layer.register_forward_pre_hook(to_host)
        layer.forward = _skippable(layer.forward, crossing)
    layers[-1].register_forward_hook(to_device)
    inner._carry = False  # (each layer called whole, so the hooks run: no residual carried across the crossing)
    inner.crossing = crossing


def _skippable(forward: Any, crossing: _Crossing) -> Any:
    def run(positions: torch.Tensor, x: torch.Tensor, *rest: Any) -> torch.Tensor:
        return x if crossing.skip else forward(positions, x, *rest)
    return run


@contextmanager
def host_layers_skipped(model: Any) -> Iterator[None]:
    """The CPU layers pass their input through unchanged: what the GPU runner's memory profile runs (one largest
    step, whose peak on the GPU the CPU layers' arithmetic does not change; run on the CPU it would take minutes
    for a 7B's thousands of tokens)."""
    crossing: _Crossing | None = getattr(model.model, "crossing", None)
    if crossing is None:
        yield
        return
    crossing.skip = True
    try:
        yield
    finally:
        crossing.skip = False
