"""PoolingParams and PoolingRequestOutput: what an embedding or scoring request asks for and gets
(vLLM's names: ``outputs.data`` is the pooled tensor; ``EmbeddingOutput.embedding`` its list)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runlm.engine.request import RequestMetrics

POOLING_TASKS = ("embed", "score", "classify")


class PoolingParamsError(ValueError):
    """An invalid pooling value; ``param`` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class TaskError(ValueError):
    """The request asks a model for something it cannot do (text from an embedder, vectors from a chat model)."""


@dataclass(slots=True)
class PoolingParams:
    task: str = "embed"
    normalize: bool | None = None               # None: what the model's own config says
    dimensions: int | None = None               # Matryoshka truncation of the embedding
    truncate_prompt_tokens: int | None = None   # keep only the last k tokens of a token-id prompt

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise PoolingParamsError("task", f"must be one of {', '.join(POOLING_TASKS)}, not {self.task!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or self.dimensions < 1):
            raise PoolingParamsError("dimensions", f"must be a positive integer, not {self.dimensions!r}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise PoolingParamsError("truncate_prompt_tokens", "must be a positive integer")


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
