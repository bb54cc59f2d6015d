"""PoolingParams: what an embedding or scoring request asks for (vLLM's names); what it gets is
``PoolingRequestOutput`` in runlm/engine/types/outputs.py."""
from __future__ import annotations

from dataclasses import dataclass

POOLING_TASKS = ("embed", "score", "classify")


class PoolingParamsError(ValueError):
    """An invalid pooling value; ``param`` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(slots=True)
class PoolingParams:
    task: str = "embed"
    normalize: bool | None = None               # None: what the model's own config says
    dimensions: int | None = None               # Matryoshka truncation of the embedding
    truncate_prompt_tokens: int | None = None   # keep only the last k tokens (-1: as many as the model takes)
    # a text longer than the model takes: cut to fit (True) or refused (False, OpenAI's /v1/embeddings and vLLM
    # unless truncate_prompt_tokens is given)
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise PoolingParamsError("task", f"must be one of {', '.join(POOLING_TASKS)}, not {self.task!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or self.dimensions < 1):
            raise PoolingParamsError("dimensions", f"must be a positive integer, not {self.dimensions!r}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1 \
                and self.truncate_prompt_tokens != -1:
            raise PoolingParamsError("truncate_prompt_tokens", "must be a positive integer, or -1 for the model's "
                                                               "maximum length")
