"""The GPU runner's torch reference attention: an AttentionBackend (runlm.models.attention) over a paged KV cache,
with the same constructor, ``set_step`` and ``forward`` as the Triton backend (runlm.kernels.triton.backend's
PagedAttentionBackend), so the runner swaps one for the other in one line.

It owns each layer's cache, [num_blocks, block_size, KVH, D] (the torch runner's [slots, KVH, D] seen in blocks),
and the step's metadata in persistent device buffers (block tables, cu_seqlens_q, seq_lens, slot mapping). Each
layer stores the new K/V by slot, then attends sequence by sequence: gather the context's slots from the block
table, SDPA with runlm.models.attention's mask (the softcapped math for Gemma 2) -- the torch runner's own
arithmetic, so on the CPU the GPU runner's greedy tokens equal the torch runner's. It reads the metadata on the
host once per step, so no CUDA graph can be captured over it (``graphable`` is False).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from runlm.models.attention import _mask, _softcapped


def _tensor(x: torch.Tensor | np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x


class ReferencePagedAttention:
    graphable = False  # reads the step's lengths on the host

    def __init__(self, num_layers: int, num_blocks: int | Sequence[int], block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str, max_num_seqs: int,
                 max_num_tokens: int, max_blocks_per_seq: int, layer_group: Sequence[int] | None = None) -> None:
        self.device = torch.device(device)
        self.block_size = block_size
        self.layer_group = list(layer_group) if layer_group is not None else [0] * num_layers
        groups = max(self.layer_group) + 1
        blocks = [num_blocks] * groups if isinstance(num_blocks, int) else list(num_blocks)
        self.caches = [(torch.zeros(blocks[g], block_size, num_kv_heads, head_dim, dtype=dtype, device=self.device),
                        torch.zeros(blocks[g], block_size, num_kv_heads, head_dim, dtype=dtype, device=self.device))
                       for g in self.layer_group]
        i32, dev = torch.int32, self.device
        self.cu_seqlens_q = torch.zeros(max_num_seqs + 1, dtype=i32, device=dev)
        self.seq_lens = torch.zeros(max_num_seqs, dtype=i32, device=dev)
        self.block_tables = [torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=i32, device=dev)
                             for _ in range(groups)]
        self.slot_mappings = [torch.full((max_num_tokens,), -1, dtype=torch.int64, device=self.device)
                              for _ in range(groups)]
        self.num_seqs = self.num_tokens = 0
        self._host: tuple[list[int], list[int]] | None = None
        self._slots: dict[int, list[torch.Tensor]] = {}

    def flat_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])) for k, v in self.caches]

    def set_step(self, block_table: torch.Tensor | np.ndarray, cu_seqlens_q: torch.Tensor | np.ndarray,
                 seq_lens: torch.Tensor | np.ndarray, slot_mapping: torch.Tensor | np.ndarray,
                 groups: Sequence[tuple[torch.Tensor | np.ndarray, torch.Tensor | np.ndarray]] = (),
                 max_query_len: int | None = None) -> None:
        table, cu, lens, slots = (_tensor(x) for x in (block_table, cu_seqlens_q, seq_lens, slot_mapping))
        b, t = lens.shape[0], slots.shape[0]
        self.cu_seqlens_q[:b + 1].copy_(cu, non_blocking=True)
        self.seq_lens[:b].copy_(lens, non_blocking=True)
        for g, (tab, sm) in enumerate([(table, slots), *((_tensor(x), _tensor(y)) for x, y in groups)]):
            self.block_tables[g][:b, :tab.shape[1]].copy_(tab, non_blocking=True)
            self.slot_mappings[g][:t].copy_(sm, non_blocking=True)
            self.slot_mappings[g][t:].fill_(-1)
        self.num_seqs, self.num_tokens = b, t
        self._host, self._slots = None, {}

    def _context_slots(self, group: int) -> list[torch.Tensor]:
        if group not in self._slots:
            assert self._host is not None
            table = self.block_tables[group]
            out = []
            for i, n in enumerate(self._host[1]):
                pos = torch.arange(n, device=self.device)
                out.append(table[i][pos // self.block_size].long().clamp(min=0) * self.block_size
                           + pos % self.block_size)
            self._slots[group] = out
        return self._slots[group]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                window: int | None, softcap: float | None) -> torch.Tensor:
        group = self.layer_group[layer]
        k_cache, v_cache = (c.view(-1, *c.shape[2:]) for c in self.caches[layer])
        slot_mapping = self.slot_mappings[group][:q.shape[0]]
        keep = slot_mapping >= 0
        k_cache.index_copy_(0, slot_mapping[keep], k[keep].to(k_cache.dtype))
        v_cache.index_copy_(0, slot_mapping[keep], v[keep].to(v_cache.dtype))
        if self._host is None:
            self._host = (self.cu_seqlens_q[:self.num_seqs + 1].tolist(), self.seq_lens[:self.num_seqs].tolist())
        starts, lens = self._host
        out = torch.zeros_like(q)
        for i, slots in enumerate(self._context_slots(group)):
            start, end = starts[i], starts[i + 1]
            if end == start:
                continue
            qs = q[start:end].transpose(0, 1)
            ks = k_cache.index_select(0, slots).transpose(0, 1).to(q.dtype)
            vs = v_cache.index_select(0, slots).transpose(0, 1).to(q.dtype)
            mask = _mask(end - start, lens[i], window, q.device)
            if softcap:
                o = _softcapped(qs, ks, vs, mask, scale, softcap)
            else:
                o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                                                     enable_gqa=True)
            out[start:end] = o.transpose(0, 1)
        return out
