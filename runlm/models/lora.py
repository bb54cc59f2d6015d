"""LoRA in the forward pass: which adapter each sequence of a step uses, and the update a Linear adds.

Around each forward pass the engine says which adapter each sequence of the step uses
(``lora_batch``). A Linear with adapters attached computes its base output once for all rows, in
whatever form its weights are held (fp32, int8 blocks, GGUF blocks as stored); then for each
adapter present in the step it gathers that adapter's rows, computes ``(x A^T) B^T`` in fp32 with the
batch-invariant linear kernel and adds it into those rows' slice of the output (a fused qkv or
gate_up layer holds one slice per projection). Rows with no adapter get nothing added. Every
operation works row by row, so a row's output is the same alone or beside rows with other adapters.

Adapters are keyed by an int the engine chooses per loaded adapter (0 means none).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from runlm.kernels import linear
from runlm.models.attention import get_forward_context
from runlm.models.linear import Linear
from runlm.models.lora_check import check_module
from runlm.models.lora_weights import LoRAError, LoRAWeights

__all__ = ["LoRABatch", "LoRALayer", "attach", "detach", "enable", "lora_batch", "lora_targets"]


@dataclass(slots=True)
class LoRABatch:
    """The adapter key of each sequence of a step, in batch order (0: none)."""
    keys: list[int]
    _lens: list[int] | None = None
    _groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)

    def groups(self, device: torch.device) -> list[tuple[int, torch.Tensor | None]]:
        """(adapter key, its rows of the flattened batch; None when it has every row), built once per step
        from the forward context's tokens per sequence."""
        lens = get_forward_context().query_lens
        if lens is self._lens:
            return self._groups
        if len(lens) != len(self.keys):
            raise RuntimeError(f"LoRA batch names {len(self.keys)} sequences, the forward pass has {len(lens)}")
        rows: dict[int, list[int]] = {}
        start = 0
        for key, n in zip(self.keys, lens):
            if key:
                rows.setdefault(key, []).extend(range(start, start + n))
            start += n
        self._groups = [(key, None if len(r) == start else torch.tensor(r, device=device))
                        for key, r in rows.items()]
        self._lens = lens
        return self._groups


_BATCH: LoRABatch | None = None


@contextmanager
def lora_batch(batch: LoRABatch | None) -> Iterator[None]:
    """Run the forward passes inside with these adapters (None, or no key set: none at all)."""
    global _BATCH
    previous, _BATCH = _BATCH, batch if batch is not None and any(batch.keys) else None
    try:
        yield
    finally:
        _BATCH = previous


class _Shard(NamedTuple):
    lo: int  # output columns lo..hi of the layer
    hi: int
    r0: int  # this shard's rows of the stacked A
    r1: int
    b: torch.Tensor  # [hi - lo, r1 - r0], scale folded in


class _Update(NamedTuple):
    a: torch.Tensor  # every shard's A stacked: [sum of ranks, in]
    shards: list[_Shard]


class LoRALayer:
    """The adapters attached to one Linear: key -> its low-rank update."""
    __slots__ = ("updates",)

    def __init__(self) -> None:
        self.updates: dict[int, _Update] = {}

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base output for x) plus each row's adapter update, in place."""
        batch = _BATCH
        if batch is None or not self.updates:
            return y
        for key, rows in batch.groups(x.device):
            update = self.updates.get(key)
            if update is None:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            # this adapter's rows of y, added into, then put back whole (index_add_ into a column slice of y
            # is ~100x slower on CPU than a gather and a row copy)
            ys = y if rows is None else y.index_select(0, rows)
            h = linear(xs.float(), update.a)
            for s in update.shards:
                d = linear(h if len(update.shards) == 1 else h[:, s.r0:s.r1].contiguous(), s.b)
                ys[:, s.lo:s.hi] += d.to(y.dtype)
            if rows is not None:
                y.index_copy_(0, rows, ys)
        return y


class _Target(NamedTuple):
    layer: Linear
    lo: int
    hi: int
    heads: int  # Q/K: heads whose rows RoPE rotates (for the interleaved layout); else 0


def lora_targets(model: torch.nn.Module) -> dict[str, _Target]:
    """HF module name -> the Linear (and its output slice) a LoRA on that module adds into: q/k/v/o and
    gate/up/down of every decoder layer, and the fused qkv_proj / gate_up_proj as checkpoints name them."""
    from runlm.models.llama import MLP

    targets: dict[str, _Target] = {}
    layers = model.get_submodule("model.layers")
    assert isinstance(layers, torch.nn.ModuleList)
    for i, layer in enumerate(layers):
        prefix = f"model.layers.{i}"
        attn = getattr(layer, "self_attn", None)
        # (not Qwen3-Next's gated attention, whose q_proj rows interleave each head's query and gate)
        if attn is not None and hasattr(attn, "qkv_proj") and not getattr(attn, "output_gate", False):
            q, kv, qkv = attn.q_size, attn.kv_size, attn.qkv_proj
            targets[f"{prefix}.self_attn.q_proj"] = _Target(qkv, 0, q, attn.heads)
            targets[f"{prefix}.self_attn.k_proj"] = _Target(qkv, q, q + kv, attn.kv_heads)
            targets[f"{prefix}.self_attn.v_proj"] = _Target(qkv, q + kv, q + 2 * kv, 0)
            targets[f"{prefix}.self_attn.qkv_proj"] = _Target(qkv, 0, q + 2 * kv, 0)
            targets[f"{prefix}.self_attn.o_proj"] = _Target(attn.o_proj, 0, attn.o_proj.out_features, 0)
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, MLP):  # a mixture of experts has no single gate/up/down to adapt
            size, gate_up = mlp.down_proj.in_features, mlp.gate_up_proj
            targets[f"{prefix}.mlp.gate_proj"] = _Target(gate_up, 0, size, 0)
            targets[f"{prefix}.mlp.up_proj"] = _Target(gate_up, size, 2 * size, 0)
            targets[f"{prefix}.mlp.gate_up_proj"] = _Target(gate_up, 0, 2 * size, 0)
            targets[f"{prefix}.mlp.down_proj"] = _Target(mlp.down_proj, 0, mlp.down_proj.out_features, 0)
    return targets


def enable(model: torch.nn.Module) -> None:
    """Give every adaptable Linear a LoRALayer (empty until an adapter is attached)."""
    for target in lora_targets(model).values():
        if target.layer.lora is None:
            target.layer.lora = LoRALayer()
    if hasattr(model.model, "_plan"):
        model.model._plan = None  # the fused loop binds each layer's call once: rebuild it with the LoRA hook


def _interleave(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of Q/K from the rotate-half layout into llama.cpp's interleaved pairs (what GGUF blocks hold)."""
    shape = w.shape
    return w.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def attach(model: torch.nn.Module, key: int, weights: LoRAWeights, max_rank: int | None = None) -> None:
    """Check every module of ``weights`` against the model, then attach them all under ``key`` (all or nothing)."""
    targets = lora_targets(model)
    interleaved = bool(getattr(model.get_submodule("model.rope"), "interleaved", False))
    per_layer: dict[int, tuple[Linear, list[tuple[int, int, torch.Tensor, torch.Tensor]]]] = {}
    for name, m in weights.modules.items():
        t = targets.get(name)
        check_module(weights.source, name, m.rank, (m.a.shape[1], m.b.shape[0]),
                     None if t is None else (t.layer.in_features, t.hi - t.lo), max_rank)
        assert t is not None
        b = _interleave(m.b, t.heads) if interleaved and t.heads else m.b
        per_layer.setdefault(id(t.layer), (t.layer, []))[1].append((t.lo, t.hi, m.a, b))
    for layer, parts in per_layer.values():
        parts.sort(key=lambda p: p[0])
        if any(p[1] > q[0] for p, q in zip(parts, parts[1:])):
            raise LoRAError(f"{weights.source}: a fused module and its parts are both adapted")
        device = layer.bias.device if layer.bias is not None else _device(layer)
        shards, r = [], 0
        for lo, hi, a, b in parts:
            shards.append(_Shard(lo, hi, r, r + a.shape[0], b.to(device).contiguous()))
            r += a.shape[0]
        stacked = torch.cat([p[2] for p in parts]).to(device).contiguous()
        if not isinstance(layer.lora, LoRALayer):
            raise RuntimeError("LoRA is not enabled on this model (call runlm.models.lora.enable first)")
        layer.lora.updates[key] = _Update(stacked, shards)


def _device(layer: Linear) -> torch.device:
    for t in (layer.weight, layer.qweight, *(s.raw for s in (*layer.ggml, *layer.device_blocks))):
        if t is not None and t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def detach(model: torch.nn.Module, key: int) -> None:
    for target in lora_targets(model).values():
        if isinstance(target.layer.lora, LoRALayer):
            target.layer.lora.updates.pop(key, None)
