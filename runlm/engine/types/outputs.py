"""What the engine hands back: RequestOutput for generation, PoolingRequestOutput for embeddings and
scores (vLLM's names), with the per-token Logprob and the request timings both carry."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one dict per position: token id -> Logprob (the chosen token plus the top-k)
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]

@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # speculative decoding: draft tokens verified for this request, and how many of them the target accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


@dataclass(slots=True)
class PoolingOutput:
    data: torch.Tensor  # [dim] for embeddings; [num_labels] for classification; [1] for a score

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()

    @property
    def score(self) -> float:
        return float(self.data[-1])


@dataclass(slots=True)
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_truncated_tokens: int = 0  # prompt tokens dropped to fit the model's maximum length
    aborted: bool = False          # ended by abort(): ``outputs.data`` is empty
    metrics: RequestMetrics | None = None
