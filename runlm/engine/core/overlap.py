"""Async scheduling (vLLM's ``--async-scheduling``, SGLang's overlap scheduler): the host off the GPU's critical
path. Step N+1 is scheduled and queued on the device while step N still runs; step N's tokens are read back,
detokenized and checked for stops while N+1 computes.

What makes it work without knowing step N's tokens:
- every sequence step N samples for gets a stand-in token, ``PENDING``, at the end of its ids, so the scheduler
  counts it (one new token to compute) and the block manager makes room for it;
- the runner feeds the rows of step N+1 that hold ``PENDING`` from step N's drawn ids on the device
  (``fed_rows``): the host never waits for them;
- when step N's tokens come back, each stand-in is swapped for the real token (``drop_pending`` then the engine's
  usual append), before any output is built or any block is hashed: the prefix cache and every output only ever
  see real tokens (``match_prefix`` never hashes a sequence's last token, the one a stand-in can be).

A sequence that step N ends (a stop token, a stop string, max_tokens) was already queued in step N+1: that row's
token is thrown away, as its sequence is finished. Sampling that reads a sequence's previous tokens on the host
(penalties, grammars, mirostat's target, a thinking budget's forced tokens) does not overlap: such a step is waited
for at once (``overlap_safe``), so every sequence gets the same tokens either way.
"""
from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq

import numpy as np

from runlm.engine.core.scheduler import SchedulerOutput
from runlm.engine.core.sequence import Sequence

PENDING = -1  # a sequence's next token, drawn by a step still running (no vocabulary has a negative id)


def overlap_safe(seq: Sequence, structured_ids: Iterable[int] = ()) -> bool:
    """Whether the next step may sample for ``seq`` before this step's token is known on the host: nothing in
    its sampling reads its previous tokens there."""
    p = seq.params
    return not (p.reads_previous_tokens or p.mirostat or seq.thinking is not None or seq.seq_id in structured_ids)


def mark_pending(seqs: Iterable[Sequence]) -> None:
    """A stand-in for the token a running step draws for each of ``seqs`` (finished ones get none)."""
    for seq in seqs:
        if not seq.is_finished:
            seq.token_ids.append(PENDING)


def drop_pending(seq: Sequence) -> None:
    """The stand-in taken away, where it is there (the real token is appended in its place, or none: aborted)."""
    if seq.token_ids and seq.token_ids[-1] == PENDING:
        seq.token_ids.pop()


def fed_rows(sched: SchedulerOutput, ids: np.ndarray, fed: Seq[Sequence]) -> tuple[list[int], list[int]]:
    """The step's rows whose token is a stand-in (``ids`` holds its rows' tokens, sequence by sequence), and for
    each the index, in the running step's sampled sequences ``fed``, of the draw it is waiting for."""
    rows = np.flatnonzero(ids == PENDING)
    if not rows.size:
        return [], []
    starts = np.cumsum([0, *sched.num_new_tokens])
    owners = np.searchsorted(starts, rows, side="right") - 1
    index = {s.seq_id: i for i, s in enumerate(fed)}
    missing = [sched.seqs[o].seq_id for o in owners if sched.seqs[o].seq_id not in index]
    if missing:
        raise RuntimeError(f"sequences {missing} hold a token no running step draws")
    return rows.tolist(), [index[sched.seqs[o].seq_id] for o in owners]
