"""Continuous batching under a per-step token budget, with recompute preemption.

Each step: running sequences go first (one decode token each, or the next chunk of a long
prompt), best (priority, arrival) first; then waiting ones are admitted while the budget,
the sequence limit and the KV cache allow. When the cache cannot hold a running sequence's
next tokens, the worst running sequence (lowest priority, latest arrival) is preempted: its
blocks are freed and it waits to be recomputed from its prompt plus what it had generated.
A waiting sequence that outranks a running one may preempt it the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from runlm.engine.core.kv_groups import AnyBlockManager
from runlm.engine.core.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512


@dataclass(slots=True)
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: AnyBlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.max_loras: int | None = None  # distinct LoRA adapters running at once (None: no adapters)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out of the schedule (finished or aborted) and free its blocks now."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq.table)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.blocks.release(seq.table)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.spec.clear()
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        out.preempted.append(seq)
        if seq in out.seqs:
            i = out.seqs.index(seq)
            del out.seqs[i], out.num_new_tokens[i]

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=Sequence.sort_key)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # a decoding sequence's draft tokens (speculative decoding) ride along, as far as the budget goes
            known = seq.num_tokens - seq.num_computed_tokens
            n = min(known + len(seq.spec.tokens), budget)
            if seq.mm is not None:  # a prompt's next chunk stops at an image's edge
                n = seq.chunk_end(seq.num_computed_tokens, seq.num_computed_tokens + n) - seq.num_computed_tokens
            seq.spec.trim(max(n - known, 0))
            while not self.blocks.grow(seq.table, seq.num_computed_tokens + n):
                self._preempt(self.running[-1], out)
                if seq.status is SequenceStatus.WAITING:
                    break
            if seq.status is SequenceStatus.WAITING:
                break
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
            i += 1
        if out.preempted:
            return out  # the cache is full: admit nobody new this step
        self.waiting.sort(key=Sequence.sort_key)
        deferred: list[Sequence] = []  # their adapter would exceed max_loras: they wait for a later step
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.lora_key and not self._lora_fits(seq.lora_key):
                deferred.append(self.waiting.pop(0))
                continue
            if seq.pooling_params is not None and seq.num_tokens > budget:
                break  # a pooling prompt is pooled whole in one step: it waits for a step with room
            # prompt logprobs (and pooling) need every prompt position computed, so they skip the cache
            admitted = self.blocks.allocate_prompt(seq.table, seq.token_ids, budget,
                                                   use_cache=not seq.wants_prompt_logprobs
                                                   and seq.pooling_params is None,
                                                   chunk_end=seq.chunk_end if seq.mm is not None else None)
            if admitted is None:
                victim = self.running[-1] if self.running else None
                if victim is None or victim.sort_key() <= seq.sort_key():
                    break
                budget += out.num_new_tokens[out.seqs.index(victim)] if victim in out.seqs else 0
                self._preempt(victim, out)
                continue
            self.waiting.pop(0)
            seq.num_computed_tokens = seq.table.num_cached_tokens
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = seq.table.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(admitted)
            budget -= admitted
        self.waiting[:0] = deferred
        return out

    def _lora_fits(self, key: int) -> bool:
        keys = {s.lora_key for s in self.running if s.lora_key}
        return key in keys or len(keys) < (self.max_loras or 0)

    def update(self, out: SchedulerOutput) -> None:
        """After the forward pass: the scheduled tokens are in the cache; share full blocks. (Accepted draft
        tokens are computed before they are appended: their blocks are shared a step later.)"""
        for seq, n in zip(out.seqs, out.num_new_tokens):
            if seq.is_finished:  # (async scheduling: the step before this one ended it, its blocks are free)
                continue
            seq.num_computed_tokens += n
            self.blocks.commit_full_blocks(seq.table, seq.token_ids, min(seq.num_computed_tokens, seq.num_tokens))
            self.blocks.release_outside_window(seq.table, seq.num_computed_tokens)
