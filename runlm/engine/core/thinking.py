"""Where a sequence is in its thinking, read from its output tokens: before it (the answer may open with the
start tag), inside it, or after it (the answer, which a grammar constrains). Once a thinking budget is spent
the closing tokens are forced, one a step, and the answer starts after the last of them.

The state is a function of the output tokens: ``sync`` reads the ones it has not seen, and starts again
from the first should the output have shrunk (a rejected draft), so it never needs to be told."""
from __future__ import annotations

from dataclasses import dataclass

from runlm.engine.types.thinking_params import ThinkingParams

BEFORE, INSIDE, AFTER = "before", "inside", "after"


@dataclass(slots=True)
class ThinkingTracker:
    params: ThinkingParams
    phase: str = BEFORE
    seen: int = 0                    # output tokens read
    spent: int = 0                   # tokens written inside the thinking (the forced ones not counted)
    forcing: int = -1                # index into close_ids of the next forced token; -1: not forcing
    answer_start: int | None = None  # output index of the answer's first token, once known

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.phase = INSIDE if self.params.inside else BEFORE
        self.seen = self.spent = 0
        self.forcing, self.answer_start = -1, None

    def sync(self, output: list[int]) -> None:
        if len(output) < self.seen:
            self.reset()
        p = self.params
        for i in range(self.seen, len(output)):
            if self.phase == BEFORE:
                if output[i] != (p.start_ids[i] if i < len(p.start_ids) else None):
                    self.phase, self.answer_start = AFTER, i   # the answer opened without thinking
                elif i + 1 == len(p.start_ids):
                    self.phase = INSIDE
            elif self.phase == INSIDE:
                if self.forcing >= 0:
                    self.forcing += 1
                    if self.forcing == len(p.close_ids):
                        self.phase, self.answer_start, self.forcing = AFTER, i + 1, -1
                elif output[max(0, i + 1 - len(p.end_ids)):i + 1] == p.end_ids:
                    self.phase, self.answer_start = AFTER, i + 1
                else:
                    self.spent += 1
        self.seen = len(output)
        if self.phase == INSIDE and self.forcing < 0 and p.budget is not None and self.spent >= p.budget:
            self.forcing = 0

    def forced_token(self) -> int | None:
        """The token the next step must take (the budget is spent), or None."""
        return self.params.close_ids[self.forcing] if self.forcing >= 0 else None

    def in_answer(self, token: int) -> bool:
        """Whether ``token``, sampled next, belongs to the answer (what a grammar constrains)."""
        if self.phase == BEFORE:
            return not (self.params.start_ids and token == self.params.start_ids[min(self.seen,
                                                                                   len(self.params.start_ids) - 1)])
        return self.phase == AFTER

    @property
    def may_open(self) -> int | None:
        """The start tag's next token while the answer may still open with it (a grammar lets it through)."""
        if self.phase == BEFORE and self.seen < len(self.params.start_ids):
            return self.params.start_ids[self.seen]
        return None
