"""Attention over a slot-addressed KV cache, driven by one global forward context.

The engine flattens every scheduled sequence's new tokens into one batch of T tokens and
describes the batch with a ``ForwardContext``: how many new tokens each sequence has, how
long its context is after this step, which cache slot each new token's K/V goes to, and the
slots of each sequence's whole context. A model is a pure forward pass; it reads the context
instead of taking cache arguments through every layer (nano-vllm's design).
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from runlm import kernels
from runlm.kernels.triton.reference import causal_mask, explicit_attention


@dataclass(slots=True)
class GroupSlots:
    """Where one KV group's layers write and read (runlm/engine/core/kv_groups.py)."""
    slot_mapping: torch.Tensor
    context_slots: list[torch.Tensor]
    flat_context_slots: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.flat_context_slots = torch.cat(self.context_slots)


class AttentionBackend(Protocol):
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                window: int | None, softcap: float | None, sinks: torch.Tensor | None = None,
                chunk: int | None = None) -> torch.Tensor: ...

    def context_kv(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``seq``'s cached K and V of layer ``layer`` this step, [context_len, KVH, D] each (read where an
        image's rows are computed again with their bidirectional mask)."""
        ...

    # where true, rope_forward rotates q and k, stores K/V and attends in the backend's kernels
    use_triton: bool

    def rope_forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, scale: float, window: int | None,
                     softcap: float | None, norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                     sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor: ...


@dataclass(slots=True)
class ForwardContext:
    query_lens: list[int]              # new tokens per sequence, in batch order
    context_lens: list[int]            # tokens per sequence after this step (cached + new)
    slot_mapping: torch.Tensor | None  # [T] cache slot for each new token
    context_slots: list[torch.Tensor] | None  # per sequence: slots of positions 0..context_len-1
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None  # per layer: (k, v), each [slots, kv_heads, head_dim]
    flat_context_slots: torch.Tensor | None = None  # context_slots concatenated; built once per step
    # a cache in groups of layers (runlm/engine/core/kv_groups.py): the fields above address group 0; layer i's
    # group is layer_group[i], and group g > 0 has its own slots in groups[g - 1]
    layer_group: list[int] | None = None
    groups: list[GroupSlots] | None = None
    # images: batch rows whose input embeddings are an image's (rows [N], values [N, hidden]), written over the
    # token embeddings; and per sequence, spans (absolute positions) whose tokens attend to each other both ways
    mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    bidirectional: list[list[tuple[int, int]]] | None = None
    # a runner's own attention (the GPU runner's paged kernels): write_kv_and_attend hands every layer to
    # ``backend.forward(layer, q, k, v, scale, window, softcap, sinks, chunk) -> [T, H, D]``
    backend: AttentionBackend | None = None
    # recurrent layers (Mamba2 mixers: runlm.models.mamba2): per layer its (conv, ssm) state tensors, one row per
    # state slot (None for an attention layer), and per sequence its slot and whether its state starts from zero
    # (its first tokens). Without them every sequence starts from zero and nothing is kept.
    states: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None
    state_slots: list[int] | None = None
    state_fresh: list[bool] | None = None
    # LoRA in device slots (runlm.models.lora.enable_device): each row's slot, -1 for none ([T] int32, on the device)
    lora_rows: torch.Tensor | None = None

    def slots_of(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor, list[torch.Tensor] | None]:
        """(slot_mapping, flat context slots, per-sequence context slots) addressing layer ``layer``'s cache."""
        g = 0 if self.layer_group is None else self.layer_group[layer]
        if g == 0:
            if self.flat_context_slots is None:
                assert self.context_slots is not None, "slots of a step without a cache"
                self.flat_context_slots = torch.cat(self.context_slots)
            return self.slot_mapping, self.flat_context_slots, self.context_slots
        assert self.groups is not None
        group = self.groups[g - 1]
        return group.slot_mapping, group.flat_context_slots, group.context_slots

    @classmethod
    def no_cache(cls, query_lens: list[int]) -> ForwardContext:
        """Plain causal attention within each sequence's tokens; nothing is stored."""
        return cls(query_lens, list(query_lens), None, None, None)


_CONTEXT: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, ctx
    try:
        yield ctx
    finally:
        _CONTEXT = previous


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("model called outside forward_context(...)")
    return _CONTEXT


def _mask(q_len: int, kv_len: int, window: int | None, device: torch.device,
          spans: Sequence[tuple[int, int]] = (), chunk: int | None = None) -> torch.Tensor | None:
    """Causal mask for the last q_len of kv_len positions (None where SDPA needs none; ``chunk``: Llama 4's chunked
    local attention, reference.causal_mask); within each of ``spans`` every position sees every other (an image's
    tokens on Gemma 3)."""
    causal = causal_mask(q_len, kv_len, window, device, chunk)
    if not spans:
        return causal
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    allowed = causal if causal is not None else torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    for start, end in spans:
        allowed |= (q_pos >= start) & (q_pos < end) & (k_pos >= start) & (k_pos < end)
    return allowed


def write_kv_and_attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        window: int | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """Store the new tokens' K/V in layer ``layer``'s cache slots, then attend over each sequence's cached
    context (kernels.paged_attention, or torch). q: [T, H, D]; k, v: [T, KVH, D]; ``sinks`` [H]: each head's
    attention-sink logit (gpt-oss); ``chunk``: attention within chunks of that many positions (Llama 4); both
    computed by torch here, by the kernels of a runner's own backend. Returns [T, H, D]."""
    ctx = get_forward_context()
    torch_only = sinks is not None or chunk is not None
    if ctx.backend is not None:
        return redo_bidirectional(layer, q, ctx.backend.forward(layer, q, k, v, scale, window, softcap, sinks, chunk),
                                  scale, window, softcap)
    if ctx.kv_caches is not None:
        k_cache, v_cache = ctx.kv_caches[layer]
        slot_mapping, flat_slots, _ = ctx.slots_of(layer)
        assert slot_mapping is not None  # a step with a cache gives every new token a slot
        k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
        out = kernels.paged_attention(q, k_cache, v_cache, flat_slots, ctx.query_lens, ctx.context_lens, scale,
                                      window, softcap) if not torch_only else None
        if out is not None:
            return redo_bidirectional(layer, q, out, scale, window, softcap)
    out = torch.empty_like(q)
    start = 0
    for i, q_len in enumerate(ctx.query_lens):
        _attend_one(ctx, layer, i, start, q, k, v, out, scale, window, softcap, sinks, chunk)
        start += q_len
    return out


def rope_write_kv_and_attend(layer: int, positions: torch.Tensor, rope: Any, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, scale: float, window: int | None = None, softcap: float | None = None,
                             norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                             sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor | None:
    """``rope`` (a RotaryEmbedding) on q and k, then write_kv_and_attend, with the rotation and the K/V store in
    one launch where the runner's backend runs Triton kernels and the rope's tables are on the device (the GPU
    runner's); None elsewhere (the caller rotates and calls write_kv_and_attend), and in a step with bidirectional
    image rows (their second pass reads the rotated queries). ``norms`` (q's and k's per-head RMSNorm weights and
    eps): applied first, in the same launch (None returned: the caller applies them)."""
    ctx = get_forward_context()
    backend = ctx.backend
    if backend is None or not backend.use_triton or not rope.sync_free or positions.ndim != 1 \
            or rope.long is not None or ctx.bidirectional is not None:
        return None
    return backend.rope_forward(layer, q, k, v, positions, rope.cos, rope.sin, rope.interleaved, scale, window,
                                softcap, norms, sinks, chunk)


def redo_bidirectional(layer: int, q: torch.Tensor, out: torch.Tensor, scale: float, window: int | None,
                       softcap: float | None) -> torch.Tensor:
    """The rows of sequences with bidirectional image spans this step, computed again with their mask (the
    causal kernels computed the rest: a text row's numerics do not depend on its neighbours)."""
    ctx = get_forward_context()
    if ctx.bidirectional is not None:
        starts = [0, *itertools.accumulate(ctx.query_lens)]
        for i, spans in enumerate(ctx.bidirectional):
            if spans:
                _attend_one(ctx, layer, i, starts[i], q, q, q, out, scale, window, softcap)  # k, v: the cache's
    return out


def _attend_one(ctx: ForwardContext, layer: int, i: int, start: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, out: torch.Tensor, scale: float, window: int | None, softcap: float | None,
                sinks: torch.Tensor | None = None, chunk: int | None = None) -> None:
    """Sequence i's rows of ``out`` (from row ``start``): its new queries over its context (the cache's, or
    k, v without one)."""
    q_len, kv_len = ctx.query_lens[i], ctx.context_lens[i]
    end = start + q_len
    if ctx.kv_caches is not None:
        k_cache, v_cache = ctx.kv_caches[layer]
        _, _, context_slots = ctx.slots_of(layer)
        assert context_slots is not None  # and every sequence its context's slots
        slots = context_slots[i]
        ks, vs = k_cache.index_select(0, slots), v_cache.index_select(0, slots)
    elif ctx.backend is not None:  # (the runner's own cache)
        ks, vs = ctx.backend.context_kv(layer, i)
    else:
        ks, vs = k[start:end], v[start:end]
    qs = q[start:end].transpose(0, 1)
    spans = ctx.bidirectional[i] if ctx.bidirectional is not None else []
    mask = _mask(q_len, kv_len, window, q.device, spans, chunk)
    ks, vs = ks.transpose(0, 1).to(q.dtype), vs.transpose(0, 1).to(q.dtype)
    if softcap or sinks is not None:
        o = explicit_attention(qs, ks, vs, mask, scale, softcap, sinks)
    else:
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
    out[start:end] = o.transpose(0, 1)
