"""The synchronous engine core: add requests, step, collect outputs. LLM and AsyncLLM drive it.

One step is: schedule, run, postprocess.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from runlm.engine.config import EngineConfig, kv_cache_blocks, physical_cores
from runlm.engine.kv_cache import BlockManager
from runlm.engine.model_runner import ModelRunner, kv_bytes_per_token
from runlm.engine.output import (
    CUMULATIVE,
    RequestState,
    append_token,
    make_output,
    new_request_state,
)
from runlm.engine.pooling_params import TaskError
from runlm.engine.request import RequestOutput, Sequence
from runlm.engine.sampler import make_generator
from runlm.engine.sampling_params import SamplingParams, SamplingParamsError
from runlm.engine.scheduler import Scheduler, SchedulerConfig
from runlm.engine.structured.backend import StructuredOutputManager
from runlm.models.load import LoadedModel, load_decoder, model_task
from runlm.store.builtin import resolve_model

if TYPE_CHECKING:
    from runlm.engine.pooling_engine import PoolingEngine

PromptType = str | Mapping[str, Any] | list[int]


class PromptError(ValueError):
    """A prompt the engine cannot take: empty, too long for the context, or with unknown token ids."""


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class LLMEngine:
    supported_tasks: tuple[str, ...] = ("generate",)

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device = torch.device(config.device)
        torch.set_num_threads(config.threads or physical_cores())
        self.loaded = loaded or load_decoder(resolve_model(str(config.model)), dtype=config.dtype,
                                             device=config.device, exact_numerics=config.exact_numerics)
        self.tokenizer = self.loaded.tokenizer
        mc = self.loaded.config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.kv_bytes_per_token = per_token = kv_bytes_per_token(self.loaded, config.dtype)
        num_blocks = kv_cache_blocks(config, per_token, self.max_model_len)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(self.max_model_len, config.max_num_seqs,
                                                   config.max_num_batched_tokens), self.blocks)
        self.runner = ModelRunner(self.loaded, self.blocks, config.dtype, self.device)
        self.requests: dict[str, RequestState] = {}
        self.eos_ids = frozenset(self.tokenizer.stop_token_ids) | frozenset(mc.eos_token_ids)
        self.structured = self.runner.structured = StructuredOutputManager(self.tokenizer, mc.vocab_size, self.eos_ids)
        self._stop_ids: dict[int, frozenset[int]] = {}
        self.num_preemptions = 0
        self.sleep_level = 0

    # ---- requests -------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, Mapping) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise PromptError("a prompt is a string, a list of token ids or {'prompt_token_ids': [...]}")

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise PromptError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PromptError(f"the prompt has {len(ids)} tokens, but the model's context length is "
                              f"{self.max_model_len} tokens; shorten the prompt")
        vocab = self.loaded.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise PromptError(f"token id {bad} in the prompt is outside the vocabulary (size {vocab})")
        needed = self.blocks.blocks_needed(len(ids) + 1)
        if needed > len(self.blocks.blocks):
            raise PromptError(f"the prompt needs {needed} KV-cache blocks but the cache holds only "
                              f"{len(self.blocks.blocks)}; raise kv_cache_memory")
        params.check_vocab(vocab)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    output_kind: str = CUMULATIVE) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TaskError("this model generates text; embeddings and scores need an embedding or reranking "
                            "model")
        text, ids = self.tokenize_prompt(prompt)
        self.check_prompt(ids, params)
        grammar = self.structured.compile(params)  # an invalid schema fails here, before anything is queued
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(ids)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        seqs = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            seq = Sequence(request_id, i, list(ids), len(ids), params, priority, arrival,
                           generator=make_generator(seed), logprobs=[] if params.logprobs is not None else None)
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))
            self._stop_ids[seq.seq_id] = frozenset(stops)
            self.structured.add(seq, grammar)
            seqs.append(seq)
        self.requests[request_id] = new_request_state(request_id, text, ids, seqs, self.tokenizer, output_kind)
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Stop requests now and free their KV blocks; returns their final outputs."""
        outs = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            state = self.requests.get(rid)
            if state is None:
                continue
            for seq in state.seqs:
                if not seq.is_finished:
                    seq.finish_reason = "abort"
                    self._finish(seq)
            out = make_output(state)
            del self.requests[rid]
            if out is not None:
                outs.append(out)
        return outs

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self._stop_ids.pop(seq.seq_id, None)
        self.structured.remove(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.sleep_level:
            raise RuntimeError("the engine is asleep; call wake_up() first")
        sched = self.scheduler.schedule()
        self.num_preemptions += len(sched.preempted)
        if not sched.seqs:
            return []
        now = time.monotonic()
        for seq in sched.seqs:
            metrics = self.requests[seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        sampled = self.runner.execute(sched, self._stop_ids)
        self.scheduler.update(sched)
        touched: dict[str, RequestState] = {}
        for s in sampled:
            state = self.requests[s.seq.request_id]
            if s.logprobs is not None:
                s.seq.logprobs.append(s.logprobs)
                s.seq.cumulative_logprob += s.logprobs[s.token].logprob
            reason = append_token(state, s.seq.index, s.token, self._stop_ids[s.seq.seq_id])
            if reason is None and s.seq.num_tokens >= self.max_model_len:
                reason = "length"
            if reason is not None:
                s.seq.finish_reason = reason
                self._finish(s.seq)
            touched[state.request_id] = state
        outputs = []
        for rid, state in touched.items():
            out = make_output(state)
            if out is not None:
                outputs.append(out)
            if state.finished:
                del self.requests[rid]
        return outputs

    # ---- control --------------------------------------------------------------------------
    def reset_prefix_cache(self) -> None:
        self.blocks.reset_prefix_cache()

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def sleep(self, level: int = 1) -> None:
        """Give memory back while idle. 1: drop the KV cache; 2: also drop the weights (reloaded on wake)."""
        if level not in (1, 2):
            raise ValueError("sleep level must be 1 or 2")
        if self.has_unfinished_requests():
            raise RuntimeError("cannot sleep with requests in flight; pause or drain first")
        self.runner.free_kv_cache()
        self.blocks.reset_prefix_cache()
        if level == 2:
            self.loaded.model.release_weights()
        self.sleep_level = max(self.sleep_level, level)

    def wake_up(self) -> None:
        if self.sleep_level == 2:
            fresh = load_decoder(self.loaded.path, dtype=self.config.dtype, device=self.config.device,
                                 exact_numerics=self.config.exact_numerics)
            self.loaded.model = fresh.model
        if self.sleep_level:
            self.runner.allocate_kv_cache()
        self.sleep_level = 0

    def stats(self) -> EngineStats:
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), self.blocks.usage,
                           self.blocks.stats.queries, self.blocks.stats.hits, self.num_preemptions)


def engine_from_model(model: str | Path, **kwargs: Any) -> LLMEngine | PoolingEngine:
    """An LLMEngine for a model that generates; a PoolingEngine for one that embeds or scores."""
    if isinstance(kwargs.get("dtype"), str):
        kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    config = EngineConfig(model=str(model), **kwargs)
    if config.task in ("embed", "score") or (
            config.task == "auto" and model_task(resolve_model(config.model)) != "generate"):
        from runlm.engine.pooling_engine import PoolingEngine

        return PoolingEngine(config)
    return LLMEngine(config)


__all__ = ["LLMEngine", "PromptError", "SamplingParamsError", "engine_from_model"]
