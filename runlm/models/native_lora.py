"""LoRA adapters on a NativeModel: runlm.models.lora's attach/detach for the native decoder.

The same targets, checks and layouts as the torch model's (q/k/v/o_proj, gate/up/down_proj and the fused
qkv_proj / gate_up_proj of every decoder layer; Q/K rows of B into llama.cpp's interleaved RoPE layout where
the GGUF's weights are), handed to runlm.native.lora in fp32. Reading an adapter (runlm.models.lora_weights)
still goes through torch; running it does not.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from runlm.formats import LoRAError
from runlm.formats.architectures import gguf_rope_interleaved
from runlm.models.lora_check import check_module
from runlm.native import lora as native_lora

if TYPE_CHECKING:
    from runlm.models.lora_weights import LoRAWeights
    from runlm.models.native import NativeModel

__all__ = ["HALF", "attach", "detach"]

# the adapters' storage on the native runner: fp16 (RUNLM_NATIVE_LORA_DTYPE=f16) or fp32, the torch path's bits
HALF = os.environ.get("RUNLM_NATIVE_LORA_DTYPE", "f32") == "f16"


class _Target(NamedTuple):
    projection: str  # runlm.native.lora.PROJECTIONS
    lo: int
    hi: int
    heads: int  # Q/K: heads whose rows RoPE rotates (for the interleaved layout); else 0
    width: int  # the projection's input features


def _targets(model: NativeModel) -> dict[str, _Target]:
    c = model.config
    h, d, inner = c.hidden_size, c.head_dim, c.intermediate_size
    q, kv = c.num_heads * d, c.num_kv_heads * d
    targets: dict[str, _Target] = {}
    for i in range(c.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        targets |= {f"{attn}.q_proj": _Target("qkv", 0, q, c.num_heads, h),
                    f"{attn}.k_proj": _Target("qkv", q, q + kv, c.num_kv_heads, h),
                    f"{attn}.v_proj": _Target("qkv", q + kv, q + 2 * kv, 0, h),
                    f"{attn}.qkv_proj": _Target("qkv", 0, q + 2 * kv, 0, h),
                    f"{attn}.o_proj": _Target("o", 0, h, 0, q)}
        if c.num_experts:  # a mixture of experts has no single gate/up/down to adapt (as on torch)
            continue
        targets |= {f"{mlp}.gate_proj": _Target("gate_up", 0, inner, 0, h),
                    f"{mlp}.up_proj": _Target("gate_up", inner, 2 * inner, 0, h),
                    f"{mlp}.gate_up_proj": _Target("gate_up", 0, 2 * inner, 0, h),
                    f"{mlp}.down_proj": _Target("down", 0, h, 0, inner)}
    return targets


def _interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of Q/K from the rotate-half layout into llama.cpp's interleaved pairs (what GGUF blocks hold)."""
    shape = w.shape
    return w.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def attach(model: NativeModel, key: int, weights: LoRAWeights, max_rank: int | None = None,
           half: bool | None = None) -> None:
    """Check every module of ``weights`` against the model, then set them all under ``key`` (all or nothing),
    stored as fp16 where ``half`` (None: HALF)."""
    if model.decoder is None:
        raise RuntimeError("the model's weights were released (sleep level 2)")
    targets = _targets(model)
    # a GGUF's Q/K rows are llama.cpp's interleaved pairs where its architecture's are; safetensors' never
    interleaved = model.gguf is not None and gguf_rope_interleaved(model.gguf.architecture)
    parts: dict[tuple[int, str], list[tuple[int, int, np.ndarray, np.ndarray]]] = {}
    for name, m in weights.modules.items():
        t = targets.get(name)
        check_module(weights.source, name, m.rank, (m.a.shape[1], m.b.shape[0]),
                     None if t is None else (t.width, t.hi - t.lo), max_rank)
        assert t is not None
        a, b = m.a.float().numpy(), m.b.float().numpy()
        b = _interleave(b, t.heads) if interleaved and t.heads else b
        layer = int(name.split(".")[2])
        parts.setdefault((layer, t.projection), []).append((t.lo, t.hi, a, b))
    updates = []
    for (layer, projection), shards in parts.items():
        shards.sort(key=lambda p: p[0])
        if any(p[1] > q[0] for p, q in zip(shards, shards[1:])):
            raise LoRAError(f"{weights.source}: a fused module and its parts are both adapted")
        a_parts = [np.ascontiguousarray(a) for _, _, a, _ in shards]
        b_parts = [native_lora.Shard(lo, hi, np.ascontiguousarray(b)) for lo, hi, _, b in shards]
        updates.append(native_lora.Update(layer, projection, a_parts, b_parts))
    native_lora.set_adapter(model.decoder, key, updates, HALF if half is None else half)


def detach(model: NativeModel, key: int) -> None:
    if model.decoder is not None:
        native_lora.drop_adapter(model.decoder, key)
