"""Block manager: chained prefix hashes, sharing, LRU reuse, fixed memory."""
from __future__ import annotations

from runlm.engine.core.kv_cache import BlockManager, BlockTable, block_hash


def test_chained_hash_depends_on_the_whole_prefix() -> None:
    a = block_hash(None, [1, 2, 3, 4])
    assert block_hash(a, [5, 6, 7, 8]) != block_hash(block_hash(None, [9, 2, 3, 4]), [5, 6, 7, 8])
    assert block_hash(a, [5, 6, 7, 8]) == block_hash(block_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8])


def test_shared_prefix_is_found_and_last_token_always_computed() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    ids = list(range(100, 112))  # 3 full blocks
    t1 = BlockTable()
    assert bm.allocate_prompt(t1, ids, budget=100) == 12
    bm.commit_full_blocks(t1, ids, 12)
    t2 = BlockTable()
    # same 12 tokens: only 2 blocks may be reused, the last token must be recomputed for its logits
    assert bm.allocate_prompt(t2, ids, budget=100) == 4
    assert t2.blocks[:2] == t1.blocks[:2] and t2.num_cached_tokens == 8
    assert bm.blocks[t1.blocks[0]].ref_count == 2
    bm.release(t1)
    bm.release(t2)
    assert bm.num_free_blocks == 16


def test_freed_cached_blocks_are_reused_until_evicted() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    ids = [1, 2, 3, 4, 5]
    t = BlockTable()
    bm.allocate_prompt(t, ids, budget=10)
    bm.commit_full_blocks(t, ids, 5)
    bm.release(t)
    t = BlockTable()
    assert bm.allocate_prompt(t, ids, budget=10) == 1 and t.num_cached_tokens == 4
    bm.release(t)
    # a different prompt needing every block evicts the cached ones
    other = BlockTable()
    assert bm.allocate_prompt(other, [9] * 8, budget=10) == 8
    assert not bm.match_prefix(ids)
    assert bm.stats.hits == 4


def test_grow_refuses_without_taking_anything_when_full() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    t = BlockTable()
    bm.allocate_prompt(t, [1, 2, 3], budget=10)
    assert bm.num_free_blocks == 0
    assert not bm.grow(t, 5) and len(t.blocks) == 2


def test_slots_map_positions_through_the_block_table() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    t = BlockTable(blocks=[5, 2])
    assert bm.slots(t, 0, 6).tolist() == [20, 21, 22, 23, 8, 9]
    assert bm.slots(t, 3, 5).tolist() == [23, 8]


def test_blocks_behind_every_window_are_given_back_while_the_sequence_runs() -> None:
    from runlm.engine.core.kv_cache import RELEASED

    m = BlockManager(num_blocks=10, block_size=4, window=8)
    table = BlockTable()
    ids = list(range(100, 120))
    assert m.allocate_prompt(table, ids, budget=64) == 20 and m.num_free_blocks == 5
    m.commit_full_blocks(table, ids, 20)
    m.release_outside_window(table, 20)  # the next token (position 20) sees positions 13..20
    assert table.blocks[:3] == [RELEASED] * 3 and table.num_released == 3 and m.num_free_blocks == 8
    slots = m.slots(table, 0, 20)
    assert slots.min() >= 0 and slots[12:].tolist() == m.slots(table, 12, 20).tolist()
    assert len(m.match_prefix(ids + [1])) == 5  # released blocks stay cached (evictable) ...
    other = BlockTable()
    m.allocate_prompt(other, ids + [1], budget=64)
    assert other.num_cached_tokens == 20  # ... and a later request with the prefix takes them back
    m.release(table)
    m.release(other)
    assert m.num_free_blocks == 10


def test_without_a_window_nothing_is_given_back() -> None:
    m = BlockManager(num_blocks=10, block_size=4)
    table = BlockTable()
    m.allocate_prompt(table, list(range(20)), budget=64)
    m.release_outside_window(table, 20)
    assert table.num_released == 0 and m.num_free_blocks == 5


def test_a_window_group_gives_blocks_back_while_the_global_group_keeps_them() -> None:
    from runlm.engine.core.kv_cache import RELEASED
    from runlm.engine.core.kv_groups import HybridBlockManager

    whole, windowed = BlockManager(num_blocks=12, block_size=4), BlockManager(num_blocks=8, block_size=4, window=8)
    m = HybridBlockManager([whole, windowed], layer_group=[1, 0, 1])
    assert m.layer_blocks(0) == 8 and m.layer_blocks(1) == 12
    table, ids = BlockTable(), list(range(100, 120))
    assert m.allocate_prompt(table, ids, budget=64) == 20
    m.commit_full_blocks(table, ids, 20)
    m.release_outside_window(table, 20)
    local = table.groups[0]
    assert table.num_released == 0 and len(table.blocks) == 5 and whole.num_free_blocks == 7
    assert local.blocks[:3] == [RELEASED] * 3 and windowed.num_free_blocks == 6
    # each group's slots address its own tensors
    assert m.slots(table, 16, 20).tolist() == whole.slots(table, 16, 20).tolist()
    assert m.group_slots(table, 16, 20)[0].tolist() == windowed.slots(local, 16, 20).tolist()
    # a prompt takes back the prefix every group still holds: all of it while the window group's given-back
    # blocks are cached, none once they are evicted
    other = BlockTable()
    assert m.allocate_prompt(other, ids + [1], budget=64) == 1 and other.num_cached_tokens == 20
    m.release(other)
    grab = BlockTable()
    assert windowed.allocate_prompt(grab, [7] * 24, budget=24, use_cache=False) == 24
    windowed.release(grab)
    other = BlockTable()
    assert m.allocate_prompt(other, ids + [1], budget=64) == 21 and other.num_cached_tokens == 0
    for t in (table, other):
        m.release(t)
    assert whole.num_free_blocks == 12 and windowed.num_free_blocks == 8


def test_a_group_without_room_refuses_the_prompt_and_nothing_is_taken() -> None:
    from runlm.engine.core.kv_groups import HybridBlockManager

    whole, windowed = BlockManager(num_blocks=12, block_size=4), BlockManager(num_blocks=2, block_size=4, window=4)
    m = HybridBlockManager([whole, windowed], layer_group=[0, 1])
    table = BlockTable()
    assert m.allocate_prompt(table, list(range(20)), budget=64) is None
    assert whole.num_free_blocks == 12 and windowed.num_free_blocks == 2 and not table.blocks
