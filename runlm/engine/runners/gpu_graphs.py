"""The GPU runner's host side, as plain functions the CPU tests check: which decode batch sizes get a CUDA
graph, how a step pads to one, and how a step's metadata is packed into one pinned host array so one
host->device copy uploads it.

One step's int64 metadata, packed in this order (``StepLayout`` gives each part's offset)::

    ids [T] | positions [T] | slot_mapping [T] | cu_seqlens_q [B + 1] | seq_lens [B] | block_table [B, W]
    then, for a cache in KV groups, per group after the first: slot_mapping{g} [T] | block_table{g} [B, W]

T rows and B sequences, padded for a graph: padding rows have id 0, position 0 and slot -1 (the KV store writes
nothing); padding sequences have no new tokens (cu_seqlens_q repeats its last value) and length 0. W is the
step's widest block table (entries past a sequence's blocks, and blocks given back, are -1).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from runlm.engine.core.batch_plan import BatchPlan
from runlm.engine.core.kv_cache import RELEASED


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes captured at start-up: 1, 2, 4, 8, 16, 32, then every 32 up to max_num_seqs, and
    max_num_seqs itself (a step pads to the next one: at most 2x rows below 32, at most 31 rows above)."""
    sizes = [s for s in (1, 2, 4, 8, 16, 32) if s < max_num_seqs]
    sizes += list(range(64, max_num_seqs, 32))
    return [*sizes, max_num_seqs]


def padded_batch_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` decodes (None: larger than every graph)."""
    return next((s for s in sorted(sizes) if s >= num_seqs), None)


def is_decode_only(plan: BatchPlan) -> bool:
    """Every sequence brings exactly one new token and nothing asks for prompt logprobs (a graph's step)."""
    return bool(plan.query_lens) and all(n == 1 for n in plan.query_lens) and not plan.prompt_logprob_rows \
        and not plan.spec_seqs


@dataclass(frozen=True, slots=True)
class StepLayout:
    num_tokens: int  # T, padded
    num_seqs: int    # B, padded
    width: int       # W: blocks per block-table row
    extra_groups: int = 0  # KV groups after the first (Gemma's sliding-window layers): their slots and tables

    @property
    def size(self) -> int:
        per_group = self.num_tokens + self.num_seqs * self.width
        return 2 * self.num_tokens + self.num_seqs + 1 + self.num_seqs + (1 + self.extra_groups) * per_group

    def parts(self) -> dict[str, tuple[int, int]]:
        """name -> (offset, length) in the packed array."""
        t, b = self.num_tokens, self.num_seqs
        offsets, out = 0, {}
        groups = [x for g in range(1, 1 + self.extra_groups)
                  for x in ((f"slot_mapping{g}", t), (f"block_table{g}", b * self.width))]
        for name, n in (("ids", t), ("positions", t), ("slot_mapping", t), ("cu_seqlens_q", b + 1),
                        ("seq_lens", b), ("block_table", b * self.width), *groups):
            out[name] = (offsets, n)
            offsets += n
        return out


def block_table_rows(tables: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """[B, width] int64, -1 past each sequence's blocks (RELEASED entries stay -1 too)."""
    out = np.full((len(tables), width), -1, dtype=np.int64)
    for i, blocks in enumerate(tables):
        row = np.asarray(blocks[:width], dtype=np.int64)
        out[i, :len(row)] = np.where(row == RELEASED, -1, row)
    return out


def pack_step(plan: BatchPlan, tables: Sequence[Sequence[int]], block_size: int, out: np.ndarray,
              pad_seqs: int | None = None, group_tables: Sequence[Sequence[Sequence[int]]] = ()) -> StepLayout:
    """Write the step's metadata into ``out`` (a pinned host array, int64, large enough) and return its layout.
    ``pad_seqs``: pad a decode-only step to this many sequences (one token each) for a graph. ``group_tables``:
    for a cache in KV groups, per group after the first its sequences' block tables (the plan's group_slots
    hold their new tokens' slots)."""
    t_real, b_real = len(plan.ids), len(plan.query_lens)
    b = pad_seqs if pad_seqs is not None else b_real
    t = t_real + (b - b_real) if pad_seqs is not None else t_real
    width = max(1, -(-max(plan.context_lens, default=1) // block_size))
    layout = StepLayout(t, b, width, len(group_tables))
    parts = layout.parts()

    def part(name: str) -> np.ndarray:
        off, n = parts[name]
        return out[off:off + n]

    for name, values, pad in (("ids", plan.ids, 0), ("positions", plan.positions, 0),
                              ("slot_mapping", plan.slot_mapping, -1)):
        dst = part(name)
        dst[:t_real] = values
        dst[t_real:] = pad
    cu = part("cu_seqlens_q")
    cu[0] = 0
    np.cumsum(plan.query_lens, out=cu[1:b_real + 1])
    cu[b_real + 1:] = cu[b_real]
    lens = part("seq_lens")
    lens[:b_real] = plan.context_lens
    lens[b_real:] = 0
    for g, (suffix, seq_tables) in enumerate([("", tables), *((str(i), x) for i, x in
                                                             enumerate(group_tables, 1))]):
        if g:  # a group after the first: its new tokens' slots, from the plan
            assert plan.group_slots is not None
            slots = part(f"slot_mapping{suffix}")
            slots[:t_real] = np.concatenate([new for new, _ in plan.group_slots[g - 1]]) if t_real else []
            slots[t_real:] = -1
        table = part(f"block_table{suffix}").reshape(b, width)
        table[:b_real] = block_table_rows(seq_tables, width)
        table[b_real:] = -1
    return layout
