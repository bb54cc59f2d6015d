"""Paged KV cache: fixed-size blocks, per-sequence block tables, automatic prefix caching.

A full block is identified by a chained hash: hash(previous block's hash, its token ids), so
equal hashes mean equal whole prefixes. Freed blocks keep their contents and hash, and sit
in an LRU free queue; a later request with the same prefix takes them back (a cache hit)
instead of recomputing. A block is only overwritten when it leaves the free queue for a new
use, so memory stays fixed at the budget however many requests pass through.

Sliding-window layers: a sequence lets go of the blocks that lie wholly before the window of its next
token while it runs (``release_outside_window``); its table keeps a hole (``RELEASED``) at their place,
and attention never reads those positions. Where global layers sit beside window layers, each kind has a
manager of its own (runlm/engine/core/kv_groups.py).
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


def block_hash(parent: bytes | None, token_ids: list[int] | tuple[int, ...], extra: bytes = b"") -> bytes:
    """``extra``: what else the block's K/V depend on (the images whose embeddings sit at its positions)."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(extra)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full and registered in the prefix cache
    # speculative decoding: a draft model's K/V for all of the block's tokens is in it too, so a sequence that
    # finds the block in the prefix cache need not have the draft recompute it (spec_decode_draft)
    draft_valid: bool = False


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0     # of those, found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


RELEASED = -1  # a block table entry whose block was given back (outside every window)


@dataclass(slots=True)
class BlockTable:
    """The blocks one sequence owns, and how many of its tokens were found in the prefix cache."""
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # hashes of its full blocks, in order
    num_cached_tokens: int = 0
    num_released: int = 0  # leading entries given back (RELEASED)
    salt: bytes | None = None  # the first block's parent hash: a LoRA adapter's KV is never shared with another's
    groups: list[BlockTable] = field(default_factory=list)  # hybrid caches: the other KV groups' tables
    # the prompt's images: (start, end, content hash); a block over an image's positions is keyed by the image too
    mm_keys: tuple[tuple[int, int, bytes], ...] = ()
    state_slot: int = -1  # recurrent layers: the slot of the sequence's state (-1: none held)


def image_keys(mm_keys: tuple[tuple[int, int, bytes], ...], start: int, end: int) -> bytes:
    """The hashes of the images whose tokens fall in positions start..end."""
    return b"".join(h for s, e, h in mm_keys if s < end and start < e)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None, state_slots: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache budget holds no block; raise kv_cache_memory")
        # recurrent layers (runlm.models.mamba2): one state slot per running sequence, taken on admission and given
        # back with its blocks (a state is not a prefix's: such a cache is never shared)
        self.state_slots = state_slots
        self.free_states = list(range(state_slots - 1, -1, -1))
        self.window = window  # every layer attends to at most this many positions (None: all)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.cached: dict[bytes, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / len(self.blocks)

    def layer_blocks(self, layer: int) -> int:
        """How many blocks layer ``layer``'s K/V tensors hold (every layer: all of them)."""
        return len(self.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
        block.hash = None
        block.draft_valid = False  # new contents: the draft's K/V there is someone else's
        block.ref_count = 1
        return block_id

    def _reuse(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def match_prefix(self, token_ids: list[int], salt: bytes | None = None,
                     mm_keys: tuple[tuple[int, int, bytes], ...] = ()) -> list[int]:
        """Cached blocks holding the longest full-block prefix of token_ids (the last token excluded,
        so at least one token is always computed and produces logits)."""
        if not self.enable_prefix_caching:
            return []
        found, parent, size = [], salt, self.block_size
        for start in range(0, len(token_ids) - 1 - size + 1, size):
            parent = block_hash(parent, token_ids[start:start + size], image_keys(mm_keys, start, start + size))
            block_id = self.cached.get(parent)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def fits_prompt(self, hits: list[int], num_tokens: int) -> bool:
        """Whether a sequence whose prefix hit ``hits`` finds room for num_tokens in all."""
        if self.state_slots and not self.free_states:
            return False
        need = self.blocks_needed(num_tokens) - len(hits)
        return need <= len(self.free) - sum(1 for b in hits if self.blocks[b].ref_count == 0)

    def allocate_prompt(self, table: BlockTable, token_ids: list[int], budget: int,
                        use_cache: bool = True, hits: list[int] | None = None,
                        chunk_end: Callable[[int, int], int] | None = None) -> int | None:
        """Start a sequence: reuse cached prefix blocks (``hits``: match_prefix's, or a prefix of them),
        then room for up to ``budget`` new tokens (``chunk_end(start, end)`` may move where they end).

        Returns how many tokens to compute now, or None (nothing taken) if they don't fit.
        """
        if hits is None:
            hits = self.match_prefix(token_ids, table.salt, table.mm_keys) if use_cache else []
        cached = len(hits) * self.block_size
        n = min(len(token_ids) - cached, budget)
        if chunk_end is not None:
            n = chunk_end(cached, cached + n) - cached
        if not self.fits_prompt(hits, cached + n):
            return None
        need = self.blocks_needed(cached + n) - len(hits)
        self.stats.queries += len(token_ids)
        self.stats.hits += cached
        for block_id in hits:
            self._reuse(block_id)
            table.hashes.append(self.blocks[block_id].hash)  # type: ignore[arg-type]  # a cached block has one
        table.blocks = list(hits) + [self._take_free() for _ in range(need)]
        table.num_cached_tokens = cached
        if self.state_slots and table.state_slot < 0:
            table.state_slot = self.free_states.pop()
        return n

    def grow(self, table: BlockTable, num_tokens: int) -> bool:
        """Make room for num_tokens in total; False (nothing taken) if the cache is full."""
        need = self.blocks_needed(num_tokens) - len(table.blocks)
        if need > len(self.free):
            return False
        table.blocks += [self._take_free() for _ in range(max(need, 0))]
        return True

    def commit_full_blocks(self, table: BlockTable, token_ids: list[int], num_computed: int) -> None:
        """Register blocks whose tokens are all computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        full = num_computed // self.block_size
        size = self.block_size
        for i in range(len(table.hashes), full):
            parent = table.hashes[-1] if table.hashes else table.salt
            h = block_hash(parent, token_ids[i * size:(i + 1) * size], image_keys(table.mm_keys, i * size,
                                                                                   (i + 1) * size))
            table.hashes.append(h)
            block = self.blocks[table.blocks[i]]
            block.hash = h
            self.cached.setdefault(h, block.block_id)

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
            if block.hash is None:
                self.free.move_to_end(block_id, last=False)  # uncached blocks are reused first

    def release(self, table: BlockTable) -> None:
        """Drop a sequence's blocks; cached ones stay reusable until evicted (tail first, so prefixes live longest)."""
        for block_id in reversed(table.blocks):
            if block_id != RELEASED:
                self._unref(block_id)
        table.blocks, table.hashes, table.num_cached_tokens, table.num_released = [], [], 0, 0
        if table.state_slot >= 0:
            self.free_states.append(table.state_slot)
            table.state_slot = -1

    def release_outside_window(self, table: BlockTable, num_computed: int) -> None:
        """Give back the blocks no later token can attend to: the next one, at position num_computed, sees
        positions num_computed - window + 1 onwards. A cached block stays shareable until evicted."""
        if self.window is None:
            return
        first_needed = max(0, num_computed - self.window + 1)
        for i in range(table.num_released, min(first_needed // self.block_size, len(table.blocks))):
            self._unref(table.blocks[i])
            table.blocks[i] = RELEASED
            table.num_released = i + 1

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their contents; they just stop being shared)."""
        self.cached.clear()
        for block in self.blocks:
            block.hash = None
            block.draft_valid = False  # (sleep drops the draft's K/V tensors along with the cache)
        self.stats = PrefixCacheStats()

    def slots(self, table: BlockTable, start: int, end: int) -> np.ndarray:
        """Flat cache slots (int64) of token positions start..end-1. Released positions get a held block's slots:
        they lie outside every window, so attention masks them (and the paged kernel never reads them). numpy,
        not torch: the engine's bookkeeping imports no torch (a torch runner wraps them with torch.from_numpy)."""
        pos = np.arange(start, end, dtype=np.int64)
        ids = table.blocks
        if table.num_released:
            held = next((b for b in ids if b != RELEASED), 0)
            ids = [held] * table.num_released + ids[table.num_released:]
        blocks = np.array(ids, dtype=np.int64)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size
