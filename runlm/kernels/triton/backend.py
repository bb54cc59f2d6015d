"""PagedAttentionBackend: the GPU runner's attention (runlm.models.attention.AttentionBackend). It owns every
layer's paged K/V cache and the step's metadata in persistent device buffers, and per layer makes two launches:
the KV store (kv_store.py) and unified paged attention (attention.py) -- Triton on CUDA, or anywhere under
TRITON_INTERPRET=1; the torch reference (reference.py) otherwise.

How a runner drives it::

    backend = PagedAttentionBackend(num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                                    dtype=torch.bfloat16, device="cuda", max_num_seqs=256,
                                    max_num_tokens=8192, max_blocks_per_seq=max_model_len // block_size)
    # once per step, before the forward pass, outside any CUDA graph:
    backend.set_step(block_table, cu_seqlens_q, seq_lens, slot_mapping)
    with forward_context(ForwardContext(..., backend=backend)):   # kv_caches=None: the backend holds them
        model(...)                                               # or replay a graph captured over it

``set_step(block_table, cu_seqlens_q, seq_lens, slot_mapping, groups=(), max_query_len=None)``:
- ``block_table``  [B, W] int32, W <= max_blocks_per_seq: sequence b's cache blocks in order (entry -1: a block
  given back outside a sliding window, never read);
- ``cu_seqlens_q`` [B + 1] int32: sequence b's new tokens are rows cu[b] .. cu[b+1] of the step's q/k/v;
- ``seq_lens``     [B] int32: sequence b's context length after this step (cached + new);
- ``slot_mapping`` [T] int64 (or int32): cache slot (block * block_size + offset) of each new token; -1 stores
  nothing (padding rows);
- ``groups``: for a cache in KV groups (runlm/engine/core/kv_groups.py; the constructor's ``layer_group``), the
  (block_table, slot_mapping) of groups 1.. (group 0 is the arguments above);
- ``max_query_len``: the longest sequence's new tokens, a host int if the runner knows it (None: unknown). A
  decode-only step (1) of few sequences (sequences x KV heads < SPLIT_BELOW_PROGRAMS) uses split-KV: each
  context in SPLIT_SEGMENTS runs by separate programs, merged by a second launch (the GPU is otherwise idle
  while one program per sequence and KV head walks a long context). The choice is made when forward runs, so a
  decode graph captured without the hint replays the one-pass kernel: capture with ``max_query_len=1``.
Arguments may be host or device tensors (or numpy arrays); they are copied into the buffers with
``non_blocking=True`` (pass pinned host tensors for an asynchronous upload). B and T are remembered as host ints:
a CUDA graph captured after ``set_step`` with B sequences and T rows replays correctly whenever ``set_step`` is
called again with the same B and T (pad sequences with zero new tokens: cu repeated, seq_lens 0; pad rows with
slot -1). Rows of q past cu[B] are left unwritten in the output. Rows past T in ``slot_mapping`` are reset to -1.

``forward(layer, q [T, H, D], k [T, KVH, D], v, scale, window, softcap, sinks=None, chunk=None) -> [T, H, D]``
stores the new K/V in the layer's cache, then attends (``sinks`` [H]: gpt-oss's attention sinks; ``chunk``: Llama
4's chunked local attention). ``caches[layer]`` is (k_cache, v_cache), each [num_blocks, block_size, KVH, D];
``flat_caches()`` gives the same memory as [slots, KVH, D] (ForwardContext.kv_caches' layout).

``latent=True`` (multi-head latent attention, runlm.models.mla): one cache per layer, its one "KV head" a token's
latent row, which is both the key and (its first values) the value -- ``caches[layer]`` is (k, k), the same tensor;
``forward(layer, q, latent, latent, ...)`` stores the row once (twice the same bytes) and the caller keeps the
output's first values.

On the CPU, ``use_triton=None`` picks the interpreter when TRITON_INTERPRET=1 was set before Triton was first
imported in the process (triton.jit decides when it decorates, Triton's own library included: one process runs
interpreted or compiled kernels, never both), and the torch reference otherwise.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from runlm.kernels.triton import available, reference

SPLIT_SEGMENTS = 16
SPLIT_BELOW_PROGRAMS = 128  # about an H100's 132 SMs; not tuned on a GPU yet
LATENT_GROUP = 16  # query heads a program of latent attention takes


@dataclass(slots=True)
class _GroupBuffers:
    block_table: torch.Tensor   # [max_num_seqs, max_blocks_per_seq] int32
    slot_mapping: torch.Tensor  # [max_num_tokens] int64
    host_slots: list[torch.Tensor] | None = field(default=None)  # reference path: context slots per sequence


def _tensor(x: torch.Tensor | np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x


def cache_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype) -> int:
    """K and V of one block in every layer."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def latent_heads(cache: torch.Tensor, heads: int) -> torch.Tensor:
    """A cache of latents (one KV head) seen as heads // LATENT_GROUP KV heads of stride 0, so a program of the
    attention kernel takes LATENT_GROUP query heads: one program of all of DeepSeek-V3's 128 heads' rows would not
    fit an H100's shared memory (576-value rows padded to 1024). Every program reads the same latents."""
    if heads <= LATENT_GROUP or heads % LATENT_GROUP:
        return cache
    return cache.expand(-1, -1, heads // LATENT_GROUP, -1)


def use_triton_on(device: torch.device) -> bool:
    """Triton on CUDA, or anywhere under TRITON_INTERPRET=1, when it is installed."""
    return available() and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def kernels() -> tuple[Callable[..., None], Callable[..., torch.Tensor]]:
    """(store_kv, paged_attention), imported on first use: Triton stays out of processes that never need it."""
    from runlm.kernels.triton.attention import paged_attention
    from runlm.kernels.triton.kv_store import store_kv
    return store_kv, paged_attention


class VarlenAttention:
    """Attention within each sequence of a batch that keeps no cache (the pooling runner's embedders and
    rerankers, where the Triton kernels run): the step's own K/V are the paged kernel's "cache" in blocks of one
    position (sequence b's position i is row cu[b] + i), so one launch a layer attends the whole batch, causally (a
    decoder) or both ways (an encoder). The step's metadata goes up in one copy."""
    use_triton = False  # (rope_forward is the paged cache's: here q and k are rotated before)

    def __init__(self, query_lens: Sequence[int], device: torch.device, causal: bool = True) -> None:
        lens = np.asarray(query_lens, dtype=np.int32)
        b, width = len(lens), int(lens.max())
        starts = np.zeros(b + 1, dtype=np.int32)
        np.cumsum(lens, out=starts[1:])
        offsets = np.arange(width, dtype=np.int32)[None, :]
        table = np.where(offsets < lens[:, None], starts[:-1, None] + offsets, -1)
        meta = torch.from_numpy(np.concatenate([starts, lens, table.ravel()]).astype(np.int32))
        meta = meta.to(device)
        self.cu, self.lens, self.table = meta[:b + 1], meta[b + 1:2 * b + 1], meta[2 * b + 1:].view(b, width)
        self.num_seqs, self.causal = b, causal

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                window: int | None, softcap: float | None, sinks: torch.Tensor | None = None,
                chunk: int | None = None) -> torch.Tensor:
        """q [T, H, D], k and v [T, KVH, D] (D contiguous) -> [T, H, D]."""
        paged_attention = kernels()[1]
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        return paged_attention(q, k.unsqueeze(1), v.unsqueeze(1), self.table, self.cu, self.lens, scale, window,
                               softcap, num_seqs=self.num_seqs, sinks=sinks, chunk=chunk, causal=self.causal)

    def context_kv(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("a batch without a cache has no context to read again")

    def rope_forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise NotImplementedError("VarlenAttention rotates nothing (use_triton is False)")


class PagedAttentionBackend:
    def __init__(self, num_layers: int, num_blocks: int | Sequence[int], block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str, max_num_seqs: int,
                 max_num_tokens: int, max_blocks_per_seq: int, layer_group: Sequence[int] | None = None,
                 use_triton: bool | None = None, kv_layers: Sequence[int] | None = None,
                 latent: bool = False) -> None:
        self.device = torch.device(device)
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.layer_group = list(layer_group) if layer_group is not None else [0] * num_layers
        num_groups = max(self.layer_group) + 1
        blocks = [num_blocks] * num_groups if isinstance(num_blocks, int) else list(num_blocks)
        if len(blocks) != num_groups or len(self.layer_group) != num_layers:
            raise ValueError("num_blocks and layer_group disagree on the number of layers or KV groups")
        self.use_triton = use_triton_on(self.device) if use_triton is None else use_triton
        self.latent = latent
        if self.use_triton and not available():
            raise RuntimeError("PagedAttentionBackend(use_triton=True) needs triton installed")
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        keeps = set(range(num_layers)) if kv_layers is None else set(kv_layers)  # (a recurrent layer keeps none)
        for layer, g in enumerate(self.layer_group):
            shape = (blocks[g] if layer in keeps else 0, block_size, num_kv_heads, head_dim)
            k = torch.zeros(shape, dtype=dtype, device=self.device)
            self.caches.append((k, k if latent else torch.zeros(shape, dtype=dtype, device=self.device)))
        self.cu_seqlens_q = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=self.device)
        self.seq_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device=self.device)
        self.groups = [_GroupBuffers(torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32,
                                                 device=self.device),
                                     torch.full((max_num_tokens,), -1, dtype=torch.int64, device=self.device))
                       for _ in range(num_groups)]
        self.num_seqs = 0
        self.num_tokens = 0
        self.max_query_len: int | None = None
        self._slots_high = 0  # slot_mapping rows that may hold a real slot (past them: -1)
        self._host_starts: list[int] | None = None  # the reference path's cu_seqlens_q, read once per step

    @property
    def graphable(self) -> bool:
        """Whether a CUDA graph can be captured over forward: the Triton path reads nothing on the host."""
        return self.use_triton

    def flat_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (k, v) cache as [slots, KVH, D]: the same memory."""
        return [(k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])) for k, v in self.caches]

    def set_step(self, block_table: torch.Tensor | np.ndarray, cu_seqlens_q: torch.Tensor | np.ndarray,
                 seq_lens: torch.Tensor | np.ndarray, slot_mapping: torch.Tensor | np.ndarray,
                 groups: Sequence[tuple[torch.Tensor | np.ndarray, torch.Tensor | np.ndarray]] = (),
                 max_query_len: int | None = None) -> None:
        """The step's metadata into the persistent buffers (see the module docstring for shapes)."""
        table, cu, lens, slots = (_tensor(x) for x in (block_table, cu_seqlens_q, seq_lens, slot_mapping))
        b, t = lens.shape[0], slots.shape[0]
        if b > self.seq_lens.shape[0] or t > self.groups[0].slot_mapping.shape[0]:
            raise ValueError(f"a step of {b} sequences and {t} tokens exceeds the backend's buffers "
                             f"({self.seq_lens.shape[0]} and {self.groups[0].slot_mapping.shape[0]})")
        if len(groups) != len(self.groups) - 1:
            raise ValueError(f"set_step got {len(groups)} extra KV groups, the cache has {len(self.groups) - 1}")
        self.cu_seqlens_q[:b + 1].copy_(cu, non_blocking=True)
        self.seq_lens[:b].copy_(lens, non_blocking=True)
        for buf, (tab, sm) in zip(self.groups, [(table, slots), *((_tensor(x), _tensor(y)) for x, y in groups)]):
            if tab.shape[1] > buf.block_table.shape[1]:
                raise ValueError(f"a block table of {tab.shape[1]} blocks; the backend holds "
                                 f"{buf.block_table.shape[1]} per sequence")
            buf.block_table[:b, :tab.shape[1]].copy_(tab, non_blocking=True)
            buf.slot_mapping[:t].copy_(sm, non_blocking=True)
            if self._slots_high > t:
                buf.slot_mapping[t:self._slots_high].fill_(-1)
            buf.host_slots = None
        self._slots_high = t
        self._host_starts = None
        self.num_seqs, self.num_tokens, self.max_query_len = b, t, max_query_len

    def num_segments(self) -> int:
        """Split-KV for this step's attention: SPLIT_SEGMENTS for a decode-only step of few sequences, else 1."""
        if self.max_query_len == 1 and self.num_seqs * self.num_kv_heads < SPLIT_BELOW_PROGRAMS:
            return SPLIT_SEGMENTS
        return 1

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                window: int | None, softcap: float | None, sinks: torch.Tensor | None = None,
                chunk: int | None = None) -> torch.Tensor:
        k_cache, v_cache = self.caches[layer]
        buf = self.groups[self.layer_group[layer]]
        num_tokens = q.shape[0]
        if self.use_triton:
            store_kv, paged_attention = kernels()
            q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
            store_kv(k, v, k_cache, v_cache, buf.slot_mapping)
            if self.latent:
                k_cache = v_cache = latent_heads(k_cache, q.shape[1])
            return paged_attention(q, k_cache, v_cache, buf.block_table, self.cu_seqlens_q, self.seq_lens, scale,
                                   window, softcap, num_seqs=self.num_seqs, num_segments=self.num_segments(),
                                   sinks=sinks, chunk=chunk)
        reference.store_kv_ref(k, v, k_cache, v_cache, buf.slot_mapping[:num_tokens])
        return self._attend_ref(buf, q, k_cache, v_cache, scale, window, softcap, sinks, chunk)

    def rope_forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, scale: float, window: int | None,
                     softcap: float | None, norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                     sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
        """``forward`` on q and k not yet rotated (nor, with ``norms``, RMS-normalized per head): the norms, the
        rotation and the K/V store in one launch (runlm.kernels.triton.fused.rope_store), then the attention. Only
        where the Triton kernels run."""
        from runlm.kernels.triton.fused import rope_store

        assert self.use_triton
        k_cache, v_cache = self.caches[layer]
        buf = self.groups[self.layer_group[layer]]
        q = rope_store(q, k, v, positions, cos, sin, interleaved, k_cache, v_cache, buf.slot_mapping, norms)
        return kernels()[1](q, k_cache, v_cache, buf.block_table, self.cu_seqlens_q, self.seq_lens, scale, window,
                            softcap, num_seqs=self.num_seqs, num_segments=self.num_segments(), sinks=sinks,
                            chunk=chunk)

    def context_kv(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``seq``'s cached K and V of layer ``layer`` this step, [seq_len, KVH, D] each (host-driven: an
        image step's bidirectional rows, never inside a graph)."""
        k_cache, v_cache = self.caches[layer]
        buf = self.groups[self.layer_group[layer]]
        slots = reference.context_slots(buf.block_table[seq], int(self.seq_lens[seq]), self.block_size)
        return k_cache.view(-1, *k_cache.shape[2:])[slots], v_cache.view(-1, *v_cache.shape[2:])[slots]

    def _attend_ref(self, buf: _GroupBuffers, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    scale: float, window: int | None, softcap: float | None, sinks: torch.Tensor | None,
                    chunk: int | None) -> torch.Tensor:
        """The torch reference, with each sequence's context slots worked out once per step."""
        if self._host_starts is None:
            self._host_starts = self.cu_seqlens_q[:self.num_seqs + 1].tolist()
        starts = self._host_starts
        if buf.host_slots is None:
            lens = self.seq_lens[:self.num_seqs].tolist()
            buf.host_slots = [reference.context_slots(buf.block_table[i], n, self.block_size)
                              for i, n in enumerate(lens)]
        k_flat, v_flat = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
        out = torch.empty_like(q)
        for i, slots in enumerate(buf.host_slots):
            start, end = starts[i], starts[i + 1]
            if end > start:
                out[start:end] = reference.attend_one(q[start:end], k_flat[slots], v_flat[slots], scale, window,
                                                      softcap, sinks, chunk)
        return out
