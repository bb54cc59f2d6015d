"""A sequence: one of a request's n completions, the unit the scheduler and the KV cache work with."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from runlm.engine.core.kv_cache import BlockTable
from runlm.engine.core.spec_state import SpecState
from runlm.engine.core.thinking import ThinkingTracker
from runlm.engine.types.outputs import PromptLogprobs, SampleLogprobs
from runlm.engine.types.pooling_params import PoolingParams
from runlm.engine.types.sampling_params import SamplingParams
from runlm.models.vision.inputs import MultiModalPrompt


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


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
    generator: np.random.Generator | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: PromptLogprobs | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first admission
    first_token_time: float | None = None
    # token ids that end this sequence: the request's stop_token_ids, plus the model's EOS unless ignore_eos
    stop_ids: frozenset[int] = frozenset()
    pooling_params: PoolingParams | None = None  # set for embedding/scoring: the whole prompt runs in one step
    lora_key: int = 0  # the loaded LoRA adapter it runs with (runlm.engine.core.lora_manager); 0: none
    spec: SpecState = field(default_factory=SpecState)  # speculative decoding: the pending draft and its record
    thinking: ThinkingTracker | None = None  # a reasoning model's thinking, when a budget or a grammar needs it
    mm: MultiModalPrompt | None = None  # the prompt's images: where their embeddings go (runlm.models.vision)
    mirostat_mu: float | None = None  # mirostat's running surprise target (runlm.engine.sample.sampler)

    def chunk_end(self, start: int, end: int) -> int:
        """Where a step computing tokens start..end should stop so that no image whose tokens attend to each
        other both ways (Gemma 3) is split between steps: before the image if it starts after ``start``, else
        past its end (over the step's budget). A causal model's image may be split anywhere: each step takes
        its slice of the image's embeddings."""
        if self.mm is None or end >= self.num_tokens:
            return end
        for f in self.mm.features:
            if f.bidirectional and f.start < end < f.end:
                return f.start if f.start > start else f.end
        return end

    def sync_thinking(self) -> ThinkingTracker | None:
        if self.thinking is not None:
            self.thinking.sync(self.output_token_ids)
        return self.thinking

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
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are the request's, not each completion's: the first of its n sequences computes them."""
        return self.params.prompt_logprobs is not None and self.index == 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple[int, float, int]:
        """Lower runs first: priority value, then arrival, then creation order."""
        return (self.priority, self.arrival_time, self.seq_id)


