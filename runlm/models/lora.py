"""LoRA in the forward pass: which adapter each sequence of a step uses, and the update a Linear adds.

Around each forward pass the engine says which adapter each sequence of the step uses
(``lora_batch``). A Linear with adapters attached computes its base output once for all rows, in
whatever form its weights are held (fp32, int8 blocks, GGUF blocks as stored); then for each
adapter present in the step it gathers that adapter's rows, computes ``(x A^T) B^T`` in fp32 with the
batch-invariant linear kernel and adds it into those rows' slice of the output (a fused qkv or
gate_up layer holds one slice per projection). Rows with no adapter get nothing added. Every
operation works row by row, so a row's output is the same alone or beside rows with other adapters.

Adapters are keyed by an int the engine chooses per loaded adapter (0 means none).

On the GPU runner's device (``enable_device``) each adapted layer also holds its adapters in slots
(``DeviceLoRA``: device buffers written at attach, cleared at detach; one slot number per adapter for the whole
model, ``LoRASlots``), and a step's forward context names each row's slot (``ForwardContext.lora_rows``): the
update is then runlm.kernels.triton.lora's two kernels over every row at once, with nothing grouped on the host,
so CUDA graphs capture it.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from runlm.kernels import linear
from runlm.kernels.triton import runs_on
from runlm.models.attention import get_forward_context
from runlm.models.linear import Linear
from runlm.models.lora_check import check_module
from runlm.models.lora_weights import LoRAError, LoRAWeights

__all__ = ["DeviceLoRA", "LoRABatch", "LoRALayer", "LoRASlots", "attach", "detach", "enable", "enable_device",
           "lora_batch", "lora_targets", "row_slots"]


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


class DeviceLoRA:
    """One layer's adapters in device slots for runlm.kernels.triton.lora: ``a`` [slots, R, in] (each projection's
    A stacked), ``b`` [slots, out, R] (each projection's B at its output rows and rank columns, zeros elsewhere);
    R = the largest rank x the projections adapted apart (q, k, v: 3)."""
    __slots__ = ("a", "b")

    def __init__(self, layer: Linear, slots: int, rank: int, dtype: torch.dtype) -> None:
        device = layer.bias.device if layer.bias is not None else _device(layer)
        self.a = torch.zeros(slots, rank, layer.in_features, dtype=dtype, device=device)
        self.b = torch.zeros(slots, layer.out_features, rank, dtype=dtype, device=device)

    def write(self, slot: int, update: _Update) -> None:
        self.clear(slot)
        self.a[slot, :update.a.shape[0]] = update.a
        for s in update.shards:
            self.b[slot, s.lo:s.hi, s.r0:s.r1] = s.b

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()


class LoRASlots:
    """Which device slot each attached adapter holds, the same in every layer of a model (``enable_device``)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.of: dict[int, int] = {}

    def take(self, key: int) -> int:
        if key in self.of:
            return self.of[key]
        used = set(self.of.values())
        free = next((i for i in range(self.count) if i not in used), None)
        if free is None:
            raise LoRAError(f"all {self.count} device LoRA slots hold adapters (max_cpu_loras, or adapters still "
                            f"in use by running requests): remove one or raise --max-cpu-loras")
        self.of[key] = free
        return free


class LoRALayer:
    """The adapters attached to one Linear: key -> its low-rank update (and on a device, their slots)."""
    __slots__ = ("updates", "device")

    def __init__(self) -> None:
        self.updates: dict[int, _Update] = {}
        self.device: DeviceLoRA | None = None

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base output for x) plus each row's adapter update, in place."""
        if self.device is not None:
            rows = get_forward_context().lora_rows
            if rows is not None:  # every row at once, by its slot (nothing grouped or read on the host)
                x2, y2 = x.reshape(-1, x.shape[-1]).contiguous(), y.view(-1, y.shape[-1])
                if runs_on(x.device.type):
                    from runlm.kernels.triton.lora import add_lora

                    add_lora(x2, y2, self.device.a, self.device.b, rows)
                else:
                    _add_by_slot(x2, y2, self.device.a, self.device.b, rows)
                return y
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


def _add_by_slot(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> None:
    """The slots' update in torch ops (the kernels' math, where Triton does not run: the GPU runner on a CPU)."""
    slot = rows[:x.shape[0]].long()
    h = torch.einsum("tk,trk->tr", x.float(), a[slot.clamp(min=0)].float())
    d = torch.einsum("tr,tnr->tn", h, b[slot.clamp(min=0)].float())
    y += torch.where(slot[:, None] >= 0, d, 0.0).to(y.dtype)


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


def enable_device(model: torch.nn.Module, slots: int, max_rank: int, dtype: torch.dtype) -> LoRASlots:
    """LoRA in device slots (see the module docstring): every adaptable layer gets its DeviceLoRA, and adapters
    already attached are written into theirs."""
    enable(model)
    targets = lora_targets(model)
    parts: dict[int, tuple[Linear, int]] = {}
    for t in targets.values():  # (the projections adapted apart: q, k, v of a fused qkv; its qkv_proj is one)
        whole = t.lo == 0 and t.hi == t.layer.out_features
        layer, n = parts.get(id(t.layer), (t.layer, 0))
        parts[id(t.layer)] = (layer, n + (0 if whole else 1))
    table = LoRASlots(slots)
    for layer, n in parts.values():
        assert isinstance(layer.lora, LoRALayer)
        layer.lora.device = DeviceLoRA(layer, slots, max_rank * max(1, n), dtype)
        for key, update in layer.lora.updates.items():
            layer.lora.device.write(table.take(key), update)
    setattr(model, "lora_slots", table)  # noqa: B010 (not a tensor or module: nn.Module's typing would refuse it)
    return table


def row_slots(model: torch.nn.Module, query_lens: list[int]) -> np.ndarray:
    """Each row of a step's flattened batch: the device slot of its sequence's adapter (-1: none), from the
    adapters the engine set for the step (``lora_batch``)."""
    table: LoRASlots = getattr(model, "lora_slots")  # noqa: B009
    out = np.full(sum(query_lens), -1, dtype=np.int32)
    if _BATCH is not None:
        if len(query_lens) != len(_BATCH.keys):
            raise RuntimeError(f"LoRA batch names {len(_BATCH.keys)} sequences, the step has {len(query_lens)}")
        start = 0
        for key, n in zip(_BATCH.keys, query_lens):
            if key:
                out[start:start + n] = table.of.get(key, -1)
            start += n
    return out


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
    updates: list[tuple[LoRALayer, _Update]] = []
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
        updates.append((layer.lora, _Update(stacked, shards)))
    table: LoRASlots | None = getattr(model, "lora_slots", None)
    slot = table.take(key) if table is not None else -1  # (before any layer changes: all or nothing)
    for lora_layer, update in updates:
        lora_layer.updates[key] = update
        if lora_layer.device is not None:
            lora_layer.device.write(slot, update)


def _device(layer: Linear) -> torch.device:
    for t in (layer.weight, layer.qweight, *(s.raw for s in (*layer.ggml, *layer.device_blocks))):
        if t is not None and t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def detach(model: torch.nn.Module, key: int) -> None:
    table: LoRASlots | None = getattr(model, "lora_slots", None)
    slot = table.of.pop(key, None) if table is not None else None
    for layer in {id(t.layer): t.layer for t in lora_targets(model).values()}.values():
        if isinstance(layer.lora, LoRALayer):
            layer.lora.updates.pop(key, None)
            if slot is not None and layer.lora.device is not None:  # (a slot given to the next adapter is clean)
                layer.lora.device.clear(slot)
