"""What one sequence carries for speculative decoding: its pending draft, and how well drafts have done."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# the running acceptance rate weighs each new verification by this much (about the last 8 drafts count)
_EMA_WEIGHT = 0.125
# a sequence that stops speculating sits out this many steps at first, twice as long each time after
_FIRST_PAUSE, _MAX_PAUSE = 64, 1024


@dataclass(slots=True)
class SpecState:
    tokens: list[int] = field(default_factory=list)  # the draft to verify in the next step
    probs: np.ndarray | None = None  # [len(tokens), V] the draft model's distribution (None: a point mass)
    num_drafted: int = 0
    num_accepted: int = 0
    recent_drafted: float = 0.0   # exponentially weighted draft and accepted counts: their ratio is the
    recent_accepted: float = 0.0  # running acceptance rate, recent verifications weighing most
    num_verified: int = 0     # verifications since speculation last (re)started
    paused_steps: int = 0     # steps left before the sequence may speculate again
    next_pause: int = _FIRST_PAUSE
    last_accepted: int | None = None  # of the last draft verified since speculation last (re)started
    draft_computed: int = 0   # positions whose draft-model KV is valid
    seen_preemptions: int = 0

    def record(self, drafted: int, accepted: int, min_rate: float, warmup: int) -> None:
        """Count one verification; below ``min_rate`` after ``warmup`` verifications, pause speculating."""
        self.num_drafted += drafted
        self.num_accepted += accepted
        self.num_verified += 1
        self.last_accepted = accepted
        self.recent_drafted += _EMA_WEIGHT * (drafted - self.recent_drafted)
        self.recent_accepted += _EMA_WEIGHT * (accepted - self.recent_accepted)
        if self.num_verified >= warmup and self.acceptance < min_rate:
            self.paused_steps, self.next_pause = self.next_pause, min(2 * self.next_pause, _MAX_PAUSE)
            self.recent_drafted = self.recent_accepted = 0.0  # a fresh start when it retries
            self.num_verified = 0
            self.last_accepted = None

    @property
    def acceptance(self) -> float:
        return self.recent_accepted / self.recent_drafted if self.recent_drafted else 1.0

    def draft_length(self, k: int) -> int:
        """k, or fewer after a draft that was mostly rejected: twice what it accepted, plus one. Each draft row
        costs the verifying step about a sixth of a one-row step on CPU, so a draft that keeps failing shrinks
        to one token until its acceptance pauses it, and one that keeps matching grows back to k."""
        return k if self.last_accepted is None else min(k, 2 * self.last_accepted + 1)

    def may_speculate(self) -> bool:
        if self.paused_steps > 0:
            self.paused_steps -= 1
            return False
        return True

    def trim(self, n: int) -> None:
        """Keep the first n draft tokens (what the step's budget has room for)."""
        if n < len(self.tokens):
            self.tokens = self.tokens[:n]
            self.probs = None if self.probs is None or not n else self.probs[:n]

    def clear(self) -> None:
        self.tokens = []
        self.probs = None
