"""The engine core for pooling models (embedders, cross-encoders): same surface and loop as LLMEngine.

A request is one sequence whose whole (truncated) prompt the Scheduler admits in one step under
the same token budget and sequence limit as generation, so concurrent requests are batched
together; the runner pools it and the request finishes in that step. Nothing stays cached
between steps, so the block manager here is admission bookkeeping only (no tensors behind it),
sized for one full step.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as HFTokenizer

from runlm.engine.core.kv_cache import BlockManager
from runlm.engine.core.scheduler import Scheduler, SchedulerConfig
from runlm.engine.core.sequence import Sequence
from runlm.engine.engine_core import EngineCore
from runlm.engine.types.config import EngineConfig
from runlm.engine.types.errors import PromptError, PromptTooLongError, TaskError
from runlm.engine.types.lora_request import LoRARequest
from runlm.engine.types.outputs import PoolingOutput, PoolingRequestOutput, RequestMetrics
from runlm.engine.types.pooling_params import PoolingParams, PoolingParamsError
from runlm.engine.types.sampling_params import SamplingParams

if TYPE_CHECKING:  # the models and the runner are torch's: imported when an engine is built
    from runlm.models.pooling_models import LoadedPoolingModel
    from runlm.models.spec import ModelSpec

PoolingPromptType = str | list[int] | Mapping[str, Any]  # also {"text": query, "text_pair": document}


@dataclass(slots=True)
class PooledPrompt:
    token_ids: list[int]
    token_type_ids: list[int] | None
    num_truncated_tokens: int


@dataclass(slots=True)
class _Request:
    seq: Sequence
    prompt: PooledPrompt
    metrics: RequestMetrics


class PoolingEngine(EngineCore):
    holds_kv_cache = False

    def __init__(self, config: EngineConfig, loaded: LoadedPoolingModel | None = None,
                 spec: ModelSpec | None = None) -> None:
        import torch

        from runlm.engine.runners.pooling import PoolingRunner
        from runlm.models.pooling_models import load_pooling_model

        if config.tensor_parallel_size > 1:
            raise ValueError("tensor parallelism splits generation models only; serve an embedding or reranking "
                             "model with tensor_parallel_size 1")
        self.config = config
        self.device = torch.device(config.device)
        task = config.task if config.task in ("embed", "score") else "auto"
        self.loaded = loaded or load_pooling_model(spec or Path(config.model), task, config.dtype, config.device)
        self.tokenizer = self.loaded.tokenizer
        self.vocab_size = self.loaded.vocab_size
        self.max_model_len = min(config.max_model_len or self.loaded.max_model_len, self.loaded.max_model_len)
        # a prompt is pooled whole in one step, so one step must hold the longest prompt
        budget = max(config.max_num_batched_tokens, self.max_model_len)
        self.blocks = BlockManager(-(-budget // config.block_size) + config.max_num_seqs, config.block_size,
                                   enable_prefix_caching=False)
        self.scheduler = Scheduler(SchedulerConfig(self.max_model_len, config.max_num_seqs, budget), self.blocks)
        self.runner = PoolingRunner(self.loaded, self.device)
        self.requests: dict[str, _Request] = {}
        # truncation keeps the special tokens ([CLS] ... [SEP]) and drops text, as sentence-transformers does
        self._truncating = HFTokenizer.from_str(self.tokenizer.hf.to_str())
        self._truncating.enable_truncation(self.max_model_len)
        self.sleep_level = 0
        self.log_start(0)

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return self.loaded.supported_tasks

    # ---- requests -------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PoolingPromptType, params: PoolingParams) -> PooledPrompt:
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            prompt = [int(t) for t in prompt["prompt_token_ids"]]
        elif isinstance(prompt, Mapping) and "prompt" in prompt:
            prompt = prompt["prompt"]
        keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt[-keep:] if keep else list(prompt)
            if len(ids) > self.max_model_len:
                raise PromptTooLongError(f"the input has {len(ids)} tokens, but this model takes at most "
                                         f"{self.max_model_len}; shorten it or set truncate_prompt_tokens",
                                         len(ids), self.max_model_len)
            return PooledPrompt(ids, None, len(prompt) - len(ids))
        if isinstance(prompt, str):
            text, pair = prompt, None
        elif isinstance(prompt, Mapping) and isinstance(prompt.get("text"), str):
            text, pair = prompt["text"], prompt.get("text_pair")
            if pair is not None and not isinstance(pair, str):
                raise PromptError("text_pair must be a string")
        else:
            raise PromptError("an input is a string, a list of token ids, {'prompt_token_ids': [...]} "
                              "or {'text': ..., 'text_pair': ...}")
        if not text and not pair:
            raise PromptError("the input is empty")
        full = self.tokenizer.hf.encode(text, pair)
        if len(full.ids) > self.max_model_len and not (params.truncate or keep):
            raise PromptTooLongError(f"the input has {len(full.ids)} tokens, but this model takes at most "
                                     f"{self.max_model_len}; shorten it or set truncate_prompt_tokens",
                                     len(full.ids), self.max_model_len)
        enc = self._truncating.encode(text, pair) if len(full.ids) > self.max_model_len else full
        ids = enc.ids
        if keep and len(ids) > keep:
            ids = ids[-keep:]
        types = enc.type_ids[-len(ids):] if pair is not None else None
        return PooledPrompt(ids, types, len(full.ids) - len(ids))

    def check_params(self, params: PoolingParams) -> None:
        loaded = self.loaded
        if params.task not in loaded.supported_tasks:
            raise TaskError(f"this model supports {', '.join(loaded.supported_tasks)}, not {params.task!r}")
        if params.dimensions is not None:
            if not loaded.pooler.matryoshka and params.dimensions != loaded.hidden_size:
                raise PoolingParamsError("dimensions", f"this model does not support shortened embeddings; its "
                                         f"embeddings have {loaded.hidden_size} dimensions")
            if params.dimensions > loaded.hidden_size:
                raise PoolingParamsError("dimensions", f"{params.dimensions} is more than the model's "
                                         f"{loaded.hidden_size} dimensions")

    def add_request(self, request_id: str, prompt: PoolingPromptType,
                    params: PoolingParams | SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, output_kind: str = "",
                    lora_request: LoRARequest | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_request is not None:
            self.lora_manager()  # raises: pooling models take no adapters
        if isinstance(params, SamplingParams):
            raise TaskError(f"{self.loaded.path.name} is an {'embedding' if self.loaded.task == 'embed' else 'scoring'}"
                            f" model; it cannot generate text")
        params = params or PoolingParams(task="embed" if self.loaded.task == "embed" else "score")
        self.check_params(params)
        pooled = self.tokenize_prompt(prompt, params)
        self.check_token_ids(pooled.token_ids, "input")
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        seq = Sequence(request_id, 0, pooled.token_ids, len(pooled.token_ids), SamplingParams(max_tokens=1),
                       priority, arrival, pooling_params=params)
        self.requests[request_id] = _Request(seq, pooled, RequestMetrics(arrival))
        self.scheduler.add(seq)

    def abort_request(self, request_ids: str | list[str]) -> list[PoolingRequestOutput]:
        import torch

        outs = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            req = self.requests.pop(rid, None)
            if req is not None:
                self.scheduler.finish(req.seq)
                outs.append(PoolingRequestOutput(rid, PoolingOutput(torch.empty(0)), req.seq.token_ids,
                                                 True, req.prompt.num_truncated_tokens, True, req.metrics))
        return outs

    # ---- the loop -------------------------------------------------------------------------
    def step(self) -> list[PoolingRequestOutput]:
        self.check_awake()
        sched = self.scheduler.schedule()
        if not sched.seqs:
            return []
        reqs = [self.requests[s.request_id] for s in sched.seqs]
        now = time.monotonic()
        try:
            vectors = self.runner.execute(sched.seqs, [r.prompt.token_type_ids for r in reqs])
        finally:
            for seq in sched.seqs:
                self.scheduler.finish(seq)
        outputs = []
        for req, vec in zip(reqs, vectors):
            del self.requests[req.seq.request_id]
            req.metrics.first_scheduled_time = now
            req.metrics.finished_time = time.monotonic()
            outputs.append(PoolingRequestOutput(req.seq.request_id, PoolingOutput(vec), req.seq.token_ids, True,
                                                req.prompt.num_truncated_tokens, False, req.metrics))
        return outputs

    # ---- control: no KV cache to drop (nothing is cached between steps); level 2 drops the weights ----
    def _drop(self, level: int) -> None:
        if level == 2:
            self.loaded.model.to_empty(device="meta")

    def _reload(self, level: int) -> None:
        if level == 2:
            from runlm.models.pooling_models import load_pooling_model

            fresh = load_pooling_model(self.loaded.path, self.loaded.task, self.config.dtype, self.config.device)
            self.loaded.model = fresh.model
