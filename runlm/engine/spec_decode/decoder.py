"""Speculative decoding: propose a draft for every decoding sequence after each step, verify it in the
next step's forward pass (batched with everything else), keep what the target agrees with.

The engine's hooks are three: ``propose`` (after a step's tokens are appended), the scheduler taking
``seq.spec.tokens`` into the sequence's tokens for the step, and ``after_verify`` (before the scheduler's
update): the rejected positions leave the sequence's computed tokens, which is the rollback in the paged
KV cache; their slots, target's and draft's, are rewritten by later tokens.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runlm.engine.core.kv_groups import AnyBlockManager
from runlm.engine.core.scheduler import SchedulerOutput
from runlm.engine.core.sequence import Sequence
from runlm.engine.spec_decode.ngram import NgramProposer
from runlm.engine.types.config import EngineConfig
from runlm.engine.types.spec_config import SpeculativeConfig

if TYPE_CHECKING:
    from runlm.engine.runners.torch_runner import SampledToken
    from runlm.engine.spec_decode.draft import DraftModelProposer

# verifications a sequence gets before its acceptance rate can pause it
_WARMUP = 2
# a step's fixed cost in rows: a step of T rows costs about (this + T) rows' worth on CPU (measured on smollm2
# Q4_1: 15 ms for one row, 2.4 to 3 ms for each further row), so a verification row is dear beside a small batch
STEP_FIXED_ROWS = 4.5


def break_even_rate(batch: int, floor: float) -> float:
    """The acceptance rate below which drafts cost a step of ``batch`` sequences more than they save: an accepted
    token saves its share of a step (STEP_FIXED_ROWS / batch + 1 rows), each draft token costs one row. One
    sequence: 0.18; eight: 0.64. ``floor`` (min_acceptance_rate) 0 turns the cost controls off."""
    return max(floor, batch / (STEP_FIXED_ROWS + batch)) if floor > 0 else 0.0


@dataclass(slots=True)
class SpecDecodeStats:
    """vLLM's spec_decode counters: drafts verified, draft tokens, accepted tokens, accepted per position."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens each verification yields: the accepted draft tokens plus the target's own."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_seq_tokens: int,
                 draft: DraftModelProposer | None = None) -> None:
        self.config, self.max_seq_tokens, self.draft = config, max_seq_tokens, draft
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max) \
            if config.method == "ngram" else None
        self.stats = SpecDecodeStats(accepted_per_position=[0] * config.num_speculative_tokens)

    def _budget(self, seq: Sequence) -> int:
        """Draft tokens worth verifying: the step yields at most k + 1 tokens, within max_tokens and the context."""
        left = (seq.params.max_tokens or self.max_seq_tokens) - seq.num_output_tokens
        return max(0, min(self.config.num_speculative_tokens, left - 1, self.max_seq_tokens - seq.num_tokens))

    def propose(self, running: list[Sequence], budget: int | None = None) -> None:
        """A draft for each sequence that is decoding (all its known tokens but the last computed). ``budget``: the
        tokens the step left of its token budget, which pays for the draft model's catching up."""
        seqs, ks = [], []
        for seq in running:
            state = seq.spec
            state.clear()
            if state.seen_preemptions != seq.num_preemptions:  # recomputed into new blocks: no draft K/V left
                state.seen_preemptions, state.draft_computed = seq.num_preemptions, 0
            if seq.num_computed_tokens != seq.num_tokens - 1 or seq.is_finished or seq.params.stateful:
                continue  # (XTC's coin and mirostat's target cannot be verified against a draft)
            k = self._budget(seq)
            if self.config.min_acceptance_rate > 0:  # the cost controls are on: shrink after rejected drafts
                k = state.draft_length(k)
            if k < 1 or not state.may_speculate():
                continue
            if self.ngram is not None:
                state.tokens = self.ngram.propose(seq.token_ids, k)
            else:
                seqs.append(seq)
                ks.append(k)
        if self.draft is not None and seqs:
            self.draft.propose(seqs, ks, budget)

    def after_verify(self, sched: SchedulerOutput, sampled: list[SampledToken]) -> None:
        """Take each draft's rejected positions out of what the step computed, and count acceptance."""
        produced = Counter(s.seq.seq_id for s in sampled)
        min_rate = break_even_rate(len(sched.seqs), self.config.min_acceptance_rate)
        for i, seq in enumerate(sched.seqs):
            state = seq.spec
            drafted = len(state.tokens)
            if not drafted:
                continue
            accepted = max(produced[seq.seq_id] - 1, 0)
            sched.num_new_tokens[i] -= drafted - accepted
            state.draft_computed = min(state.draft_computed, seq.num_computed_tokens + sched.num_new_tokens[i])
            state.record(drafted, accepted, min_rate, _WARMUP)
            st = self.stats
            st.num_drafts += 1
            st.num_draft_tokens += drafted
            st.num_accepted_tokens += accepted
            for pos in range(accepted):
                st.accepted_per_position[pos] += 1
            state.clear()


def spec_decoder(config: EngineConfig, draft: Any, blocks: AnyBlockManager, max_seq_tokens: int) -> SpecDecoder | None:
    """The engine's speculative decoder (None: it does not speculate), proposing by n-grams or by ``draft``
    (runlm.engine.spec_decode.draft.configured_draft's model)."""
    if config.speculative_config is None:
        return None
    if draft is not None and blocks.window is not None:
        raise ValueError("speculative_config: a draft model needs a target whose layers are not all "
                         "sliding-window (the draft would read blocks the target gives back)")
    from runlm.engine.spec_decode.draft import DraftModelProposer

    return SpecDecoder(config.speculative_config, max_seq_tokens,
                       DraftModelProposer(config, draft, blocks) if draft is not None else None)
