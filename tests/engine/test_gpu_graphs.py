"""The GPU runner's host side as plain functions (runlm.engine.runners.gpu_graphs): which decode batches get a
CUDA graph, how a step pads to one, and the packed step metadata. The capture itself needs CUDA
(tests/engine/test_gpu_cuda.py)."""
from __future__ import annotations

import numpy as np

from runlm.engine.core.batch_plan import BatchPlan
from runlm.engine.core.kv_cache import RELEASED
from runlm.engine.runners.gpu_graphs import (
    StepLayout,
    block_table_rows,
    graph_batch_sizes,
    is_decode_only,
    pack_step,
    padded_batch_size,
)


def test_graph_sizes_are_powers_of_two_then_steps_of_32_up_to_max_num_seqs() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(256) == [1, 2, 4, 8, 16, 32, *range(64, 257, 32)]
    assert graph_batch_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 96, 100]


def test_a_decode_batch_pads_to_the_next_captured_size() -> None:
    sizes = graph_batch_sizes(256)
    assert [padded_batch_size(n, sizes) for n in (1, 3, 5, 17, 33, 65, 256)] == [1, 4, 8, 32, 64, 96, 256]
    assert padded_batch_size(257, sizes) is None


def _plan(query_lens: list[int], context_lens: list[int]) -> BatchPlan:
    ids, pos, slots = [], [], []
    for q, c in zip(query_lens, context_lens):
        ids += list(range(100, 100 + q))
        pos += list(range(c - q, c))
        slots += [1000 + p for p in range(c - q, c)]
    return BatchPlan(np.array(ids), np.array(pos), np.array(slots), [], query_lens, context_lens)


def test_only_one_token_steps_are_graph_steps() -> None:
    assert is_decode_only(_plan([1, 1, 1], [5, 9, 2]))
    assert not is_decode_only(_plan([1, 4], [5, 9]))
    assert not is_decode_only(_plan([], []))


def test_packed_step_real_rows_then_padding() -> None:
    plan = _plan([1, 1, 1], [5, 9, 17])
    tables = [[3, 4], [7, 8, 9], [1, RELEASED, 2, 5, 6]]
    out = np.zeros(StepLayout(16, 8, 8).size, dtype=np.int64)
    layout = pack_step(plan, tables, 4, out, pad_seqs=4)
    assert (layout.num_tokens, layout.num_seqs, layout.width) == (4, 4, 5)
    parts = {name: out[o:o + n] for name, (o, n) in layout.parts().items()}
    assert parts["ids"].tolist() == [100, 100, 100, 0]
    assert parts["positions"].tolist() == [4, 8, 16, 0]
    assert parts["slot_mapping"].tolist() == [1004, 1008, 1016, -1]  # a padding row stores nothing
    assert parts["cu_seqlens_q"].tolist() == [0, 1, 2, 3, 3]  # the padding sequence has no tokens
    assert parts["seq_lens"].tolist() == [5, 9, 17, 0]
    assert parts["block_table"].reshape(4, 5).tolist() == [[3, 4, -1, -1, -1], [7, 8, 9, -1, -1], [1, -1, 2, 5, 6],
                                                          [-1] * 5]


def test_packed_mixed_step_is_not_padded() -> None:
    plan = _plan([3, 1], [3, 7])
    out = np.zeros(64, dtype=np.int64)
    layout = pack_step(plan, [[0], [1, 2]], 4, out)
    parts = {name: out[o:o + n] for name, (o, n) in layout.parts().items()}
    assert (layout.num_tokens, layout.num_seqs) == (4, 2)
    assert parts["cu_seqlens_q"].tolist() == [0, 3, 4]
    assert parts["positions"].tolist() == [0, 1, 2, 6]
    assert block_table_rows([[0], [1, 2]], 2).tolist() == [[0, -1], [1, 2]]


def test_a_kv_group_after_the_first_packs_its_own_slots_and_tables() -> None:
    """Gemma's sliding-window group: its new tokens' slots (the plan's group_slots) and its block tables (blocks
    behind the window given back: -1) after the main group's, padded alike."""
    plan = _plan([1, 1], [5, 9])
    plan.group_slots = [[(np.array([40]), np.arange(36, 41)), (np.array([77]), np.arange(69, 78))]]
    out = np.zeros(StepLayout(8, 4, 4, 1).size, dtype=np.int64)
    layout = pack_step(plan, [[3, 4], [7, 8, 9]], 4, out, pad_seqs=4, group_tables=[[[9, 10], [RELEASED, 19, 20]]])
    assert layout.extra_groups == 1 and layout.size == StepLayout(4, 4, 3, 1).size
    parts = {name: out[o:o + n] for name, (o, n) in layout.parts().items()}
    assert parts["slot_mapping"].tolist() == [1004, 1008, -1, -1]
    assert parts["slot_mapping1"].tolist() == [40, 77, -1, -1]
    assert parts["block_table1"].reshape(4, 3).tolist() == [[9, 10, -1], [-1, 19, 20], [-1] * 3, [-1] * 3]
