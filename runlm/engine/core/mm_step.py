"""What a step's images add to its forward pass, worked out from the schedule (numpy only; both runners
use it): which batch rows take an image's embedding rows instead of their token's, the spans where a
model attends bidirectionally among an image's tokens, and M-RoPE positions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from runlm.engine.core.scheduler import SchedulerOutput
from runlm.models.vision.inputs import ImageFeature


@dataclass(slots=True)
class StepImages:
    rows: np.ndarray  # int64 [N]: batch rows that take image embeddings, in the order of ``parts``
    # per image used this step: the rows of its embeddings these batch rows take
    parts: list[tuple[ImageFeature, np.ndarray]] = field(default_factory=list)
    # per sequence in batch order: (start, end) spans (absolute positions) of bidirectional images this step
    # computes some of; None when no sequence has one
    bidirectional: list[list[tuple[int, int]]] | None = None


def step_images(sched: SchedulerOutput) -> StepImages | None:
    """None when no scheduled token is an image's."""
    rows: list[np.ndarray] = []
    parts: list[tuple[ImageFeature, np.ndarray]] = []
    spans: list[list[tuple[int, int]]] = []
    row = 0
    for seq, n in zip(sched.seqs, sched.num_new_tokens):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        seq_spans: list[tuple[int, int]] = []
        if seq.mm is not None and start < seq.num_prompt_tokens:
            for f in seq.mm.features:
                if f.end <= start or f.start >= end:
                    continue
                lo, hi = np.searchsorted(f.positions, [start, end])
                if hi > lo:
                    rows.append(f.positions[lo:hi] - start + row)
                    parts.append((f, np.arange(lo, hi, dtype=np.int64)))
                if f.bidirectional:
                    seq_spans.append((f.start, f.end))
        spans.append(seq_spans)
        row += n
    if not parts:
        return None
    return StepImages(np.concatenate(rows).astype(np.int64), parts,
                      spans if any(spans) else None)


def mrope_positions(sched: SchedulerOutput, total: int) -> np.ndarray:
    """int64 [3, T] M-RoPE positions of the step's rows: a prompt token's from its processor, a later one's
    i + delta on every axis (and plain positions for a sequence without images)."""
    out = np.empty((3, total), dtype=np.int64)
    row = 0
    for seq, n in zip(sched.seqs, sched.num_new_tokens):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        mm = seq.mm
        if mm is None or mm.mrope_positions is None:
            out[:, row:row + n] = np.arange(start, end, dtype=np.int64)
        else:
            prompt = mm.mrope_positions.shape[1]
            cut = min(max(prompt, start), end)
            out[:, row:row + cut - start] = mm.mrope_positions[:, start:cut]
            out[:, row + cut - start:row + n] = np.arange(cut, end, dtype=np.int64) + mm.mrope_delta
        row += n
    return out
