"""ThinkingParams: where a reasoning model's thinking starts and ends, in token ids, for the engine's two
uses of it: a thinking budget (when it is spent, the tokens that close the thinking are forced into the
sequence) and structured outputs (the grammar constrains only the answer after the thinking)."""
from __future__ import annotations

from dataclasses import dataclass, field

from runlm.engine.types.errors import SamplingParamsError


@dataclass(slots=True)
class ThinkingParams:
    end_ids: list[int]                  # the closing tag as the tokenizer writes it alone (``</think>``)
    start_ids: list[int] = field(default_factory=list)  # the opening tag; the answer may begin with it
    close_ids: list[int] = field(default_factory=list)  # forced when the budget is spent (``\n</think>\n\n``)
    inside: bool = False                # the prompt opened the thinking: the answer starts inside it
    budget: int | None = None           # thinking tokens allowed (vLLM's thinking_token_budget); None: no limit

    def __post_init__(self) -> None:
        if not self.end_ids:
            raise SamplingParamsError("thinking_token_budget", "the end of thinking needs at least one token")
        if not self.close_ids:
            self.close_ids = list(self.end_ids)
        if self.budget is not None and (not isinstance(self.budget, int) or self.budget < 0):
            raise SamplingParamsError("thinking_token_budget",
                                      f"must be a non-negative integer, got {self.budget!r}")
