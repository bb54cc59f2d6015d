"""A paged KV cache in groups of layers: global layers and sliding-window layers (Gemma 2 and 3).

One block id space cannot serve both kinds: a global layer needs every block of a sequence, a window layer
only the last few, so a block given back for the window layers would still be held for the global ones.
So each kind of layer has its own ``BlockManager`` (its own blocks, and its own K/V tensors sized by them),
and a sequence one table per group: the ``BlockTable`` itself for the first (global) group, ``table.groups``
for the others. The window group gives its blocks back as the sequence runs and is sized for the window
(plus a step's new tokens), not for whole contexts; the budget it does not need goes to the global group.

It answers the scheduler's calls as one ``BlockManager`` does, applying each to every group; the stats,
capacity and the table's own fields are the global group's. A prompt reuses the cached prefix that every
group still holds (the window group's blocks may have been evicted sooner).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from runlm.engine.core.kv_cache import BlockManager, BlockTable, PrefixCacheStats
from runlm.models.config import ModelConfig


class HybridBlockManager:
    def __init__(self, groups: Sequence[BlockManager], layer_group: Sequence[int]) -> None:
        if len({g.block_size for g in groups}) != 1:
            raise ValueError("every KV group must use one block size")
        self.groups = list(groups)
        self.layer_group = list(layer_group)  # per layer: the index of the group holding its K/V
        self.main = self.groups[0]
        self.block_size = self.main.block_size
        self.enable_prefix_caching = self.main.enable_prefix_caching
        self.window = None  # the main group's: a sequence's length is bounded by its capacity

    @property
    def blocks(self) -> list:
        return self.main.blocks

    @property
    def stats(self) -> PrefixCacheStats:
        return self.main.stats

    @property
    def num_free_blocks(self) -> int:
        return self.main.num_free_blocks

    @property
    def state_slots(self) -> int:
        return self.main.state_slots

    @property
    def usage(self) -> float:
        return max(g.usage for g in self.groups)

    def blocks_needed(self, num_tokens: int) -> int:
        return self.main.blocks_needed(num_tokens)

    def layer_blocks(self, layer: int) -> int:
        """How many blocks layer ``layer``'s K/V tensors hold."""
        return len(self.groups[self.layer_group[layer]].blocks)

    def _tables(self, table: BlockTable) -> list[BlockTable]:
        while len(table.groups) < len(self.groups) - 1:
            table.groups.append(BlockTable())
        for t in table.groups:
            t.salt, t.mm_keys = table.salt, table.mm_keys  # an adapter's KV is its own in every group
        return [table, *table.groups]

    def allocate_prompt(self, table: BlockTable, token_ids: list[int], budget: int,
                        use_cache: bool = True, chunk_end: Callable[[int, int], int] | None = None) -> int | None:
        found = [g.match_prefix(token_ids, table.salt, table.mm_keys) if use_cache else [] for g in self.groups]
        common = min(len(f) for f in found)
        hits = [f[:common] for f in found]
        cached = common * self.block_size
        n = min(len(token_ids) - cached, budget)
        if chunk_end is not None:
            n = chunk_end(cached, cached + n) - cached
        if not all(g.fits_prompt(h, cached + n) for g, h in zip(self.groups, hits)):
            return None
        for g, t, h in zip(self.groups, self._tables(table), hits):
            g.allocate_prompt(t, token_ids, budget, use_cache, hits=h, chunk_end=chunk_end)
        return n

    def grow(self, table: BlockTable, num_tokens: int) -> bool:
        # a group that grew keeps its blocks if another cannot: the retry after a preemption needs them anyway
        return all([g.grow(t, num_tokens) for g, t in zip(self.groups, self._tables(table))])

    def commit_full_blocks(self, table: BlockTable, token_ids: list[int], num_computed: int) -> None:
        for g, t in zip(self.groups, self._tables(table)):
            g.commit_full_blocks(t, token_ids, num_computed)

    def release(self, table: BlockTable) -> None:
        for g, t in zip(self.groups, self._tables(table)):
            g.release(t)

    def release_outside_window(self, table: BlockTable, num_computed: int) -> None:
        for g, t in zip(self.groups, self._tables(table)):
            g.release_outside_window(t, num_computed)

    def reset_prefix_cache(self) -> None:
        for g in self.groups:
            g.reset_prefix_cache()

    def slots(self, table: BlockTable, start: int, end: int) -> np.ndarray:
        return self.main.slots(table, start, end)

    def group_slots(self, table: BlockTable, start: int, end: int) -> list[np.ndarray]:
        """Per group after the first, the slots of positions start..end-1."""
        return [g.slots(t, start, end) for g, t in zip(self.groups[1:], self._tables(table)[1:])]


AnyBlockManager = BlockManager | HybridBlockManager


def has_kv_groups(mc: ModelConfig) -> bool:
    """Whether the model's layers keep KV caches of different sizes (sliding-window layers beside global ones)."""
    return len({mc.layer_window(i) for i in range(mc.num_layers)}) > 1


def block_manager(mc: ModelConfig, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                  max_num_seqs: int, max_num_batched_tokens: int, state_slots: int = 0) -> AnyBlockManager:
    """The cache for a model's layers, ``num_blocks`` blocks' worth of every layer: one group where all layers
    attend alike (a window every layer has gives blocks back as a sequence runs), else a global group and a
    window group that takes only the blocks its window needs, the rest of the budget going to the global one. A model
    with recurrent layers gets ``state_slots`` (runlm.engine.types.config.state_slots) beside its blocks."""
    windows = [mc.layer_window(i) for i in range(mc.num_layers)]
    if mc.recurrent_layers:  # a state per sequence beside the blocks; a recurrent state is no prefix's to share
        return BlockManager(num_blocks, block_size, False, windows[0], state_slots=state_slots)
    if not has_kv_groups(mc):
        return BlockManager(num_blocks, block_size, enable_prefix_caching, windows[0])
    window = max(w for w in windows if w)
    n_local = sum(1 for w in windows if w)
    local = min(num_blocks, window_group_blocks(window, block_size, max_num_seqs, max_num_batched_tokens))
    total = num_blocks * len(windows)
    main = (total - local * n_local) // (len(windows) - n_local)
    return HybridBlockManager([BlockManager(main, block_size, enable_prefix_caching),
                               BlockManager(local, block_size, enable_prefix_caching, window)],
                              [1 if w else 0 for w in windows])


def window_group_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Blocks a window group needs at most: each running sequence's window and the block it spills into,
    and one step's new tokens (a prefill chunk is written before the blocks behind it are given back)."""
    per_window = -(-window // block_size) + 2
    return max_num_seqs * per_window + -(-max_num_batched_tokens // block_size)
