"""A request's state inside the engine, and what the engine hands back (vLLM's RequestOutput)."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from runlm.engine.kv_cache import BlockTable
from runlm.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from runlm.engine.pooling_params import PoolingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one dict per position: token id -> Logprob (the chosen token plus the top-k)
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]

_seq_counter = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    """One of a request's n completions: the unit the scheduler and KV cache work with."""
    request_id: str
    index: int
    token_ids: list[int]            # prompt + generated so far
    num_prompt_tokens: int
    params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    table: BlockTable = field(default_factory=BlockTable)
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: PromptLogprobs | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first admission
    first_token_time: float | None = None
    pooling_params: PoolingParams | None = None  # set for embedding/scoring: the whole prompt runs in one step

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple[int, float, int]:
        """Lower runs first: priority value, then arrival, then creation order."""
        return (self.priority, self.arrival_time, self.seq_id)


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
