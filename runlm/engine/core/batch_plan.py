"""One scheduled step flattened for a forward pass, in numpy: which token ids at which positions, which
KV-cache slots they write and read, and which rows to sample. Every runner builds it the same way (the
torch runner wraps the arrays without a copy; the native runner hands them to its kernels).

Prefill chunks and decode tokens alike: each sequence contributes rows start..end. A speculating
sequence brings its draft tokens after its last known token; its 1 + k rows are verified instead of
sampled.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from runlm.engine.core.kv_groups import AnyBlockManager, HybridBlockManager
from runlm.engine.core.scheduler import SchedulerOutput
from runlm.engine.core.sequence import Sequence


@dataclass(slots=True)
class PromptLogprobRows:
    """Hidden rows ``first_row .. first_row + count`` predict prompt positions ``first_pos + 1 ..``."""
    seq: Sequence
    first_row: int
    first_pos: int
    count: int


@dataclass(slots=True)
class BatchPlan:
    ids: np.ndarray            # int64 [T]
    positions: np.ndarray      # int64 [T]
    slot_mapping: np.ndarray   # int64 [T]: the cache slot each new token's K/V goes to
    context_slots: list[np.ndarray]  # per sequence: int64 slots of positions 0..context_len-1
    query_lens: list[int]      # new tokens per sequence
    context_lens: list[int]    # tokens per sequence after this step
    sample_rows: list[int] = field(default_factory=list)
    sample_seqs: list[Sequence] = field(default_factory=list)
    # speculating sequences: the first of their 1 + k rows (the last known token, then the draft tokens)
    spec_rows: list[int] = field(default_factory=list)
    spec_seqs: list[Sequence] = field(default_factory=list)
    prompt_logprob_rows: list[PromptLogprobRows] = field(default_factory=list)
    # a cache in groups of layers: per group after the first, per sequence (new tokens' slots, context slots)
    group_slots: list[list[tuple[np.ndarray, np.ndarray]]] | None = None
    # recurrent layers: per sequence, its state slot and whether its state starts from zero (its first tokens)
    state_slots: list[int] = field(default_factory=list)
    state_fresh: list[bool] = field(default_factory=list)


def plan_batch(sched: SchedulerOutput, blocks: AnyBlockManager) -> BatchPlan:
    hybrid = blocks if isinstance(blocks, HybridBlockManager) else None
    ids: list[int] = []
    positions: list[np.ndarray] = []
    slot_maps: list[np.ndarray] = []
    context_slots: list[np.ndarray] = []
    per_seq_groups: list[list[tuple[np.ndarray, np.ndarray]]] = []
    plan = BatchPlan(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64), context_slots,
                     list(sched.num_new_tokens), [])
    row = 0
    for seq, n in zip(sched.seqs, sched.num_new_tokens):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        ids.extend(seq.token_ids[start:end])
        num_draft = max(end - seq.num_tokens, 0)  # the scheduler trimmed the draft to what it scheduled
        ids.extend(seq.spec.tokens[:num_draft])
        positions.append(np.arange(start, end, dtype=np.int64))
        # the new tokens' slots are the tail of the context's: one lookup serves both
        context = np.asarray(blocks.slots(seq.table, 0, end), dtype=np.int64)
        slot_maps.append(context[start:])
        context_slots.append(context)
        plan.context_lens.append(end)
        plan.state_slots.append(seq.table.state_slot)
        plan.state_fresh.append(start == 0)
        if hybrid is not None:
            per_seq_groups.append([(c[start:], c) for c in (np.asarray(g, dtype=np.int64)
                                                             for g in hybrid.group_slots(seq.table, 0, end))])
        # a preempted sequence recomputes its prompt: its prompt logprobs are already there
        if seq.wants_prompt_logprobs and start < seq.num_prompt_tokens - 1 and seq.num_preemptions == 0:
            last = min(end, seq.num_prompt_tokens - 1)
            plan.prompt_logprob_rows.append(PromptLogprobRows(seq, row, start, last - start))
        row += n
        if num_draft:
            plan.spec_rows.append(row - num_draft - 1)
            plan.spec_seqs.append(seq)
        elif end == seq.num_tokens:
            plan.sample_rows.append(row - 1)
            plan.sample_seqs.append(seq)
    plan.ids = np.asarray(ids, dtype=np.int64)
    plan.positions = np.concatenate(positions) if positions else plan.positions
    plan.slot_mapping = np.concatenate(slot_maps) if slot_maps else plan.slot_mapping
    if hybrid is not None:
        plan.group_slots = [[per[g] for per in per_seq_groups] for g in range(len(hybrid.groups) - 1)]
    return plan
