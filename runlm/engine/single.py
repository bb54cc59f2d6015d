"""One conversation on one model: prefill, then decode token by token.

Keeps the KV cache of the last sequence it ran, so a multi-turn chat only computes the new
turn: the next prompt reuses the cached positions it shares with the previous one.
"""
from __future__ import annotations

from typing import Iterator

import torch

from runlm.engine.sampler import make_generator, sample
from runlm.engine.sampling_params import SamplingParams
from runlm.models.attention import ForwardContext, forward_context
from runlm.models.registry import LoadedModel


class ContextLengthError(ValueError):
    """The prompt does not fit the model's context window."""


class SingleStream:
    def __init__(self, loaded: LoadedModel, max_model_len: int | None = None, prefill_chunk: int = 512) -> None:
        self.loaded = loaded
        cfg = loaded.config
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.prefill_chunk = prefill_chunk
        dtype = next(loaded.model.parameters()).dtype
        shape = (self.max_model_len, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype))
                          for _ in range(cfg.num_layers)]
        self.slots = torch.arange(self.max_model_len)
        self.cached: list[int] = []

    def _forward(self, ids: list[int], start: int) -> torch.Tensor:
        """Run ids at positions start.. and return the last position's logits."""
        end = start + len(ids)
        ctx = ForwardContext([len(ids)], [end], self.slots[start:end], [self.slots[:end]], self.kv_caches)
        with torch.inference_mode(), forward_context(ctx):
            hidden = self.loaded.model(torch.tensor(ids), torch.arange(start, end))
            return self.loaded.model.compute_logits(hidden[-1:])

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        """Yield generated token ids until a stop token, max_tokens or the context limit."""
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ContextLengthError(f"the prompt has {len(prompt_ids)} tokens but the model's context is "
                                     f"{self.max_model_len} tokens (room is needed for at least one more)")
        params.check_vocab(self.loaded.config.vocab_size)
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= set(self.loaded.tokenizer.stop_token_ids) | set(self.loaded.config.eos_token_ids)
        generator = make_generator(params.seed)
        reuse = 0
        for a, b in zip(self.cached, prompt_ids[:-1]):  # always recompute the last prompt token
            if a != b:
                break
            reuse += 1
        self.cached = list(prompt_ids[:reuse])
        logits = None
        for start in range(reuse, len(prompt_ids), self.prefill_chunk):
            chunk = prompt_ids[start:start + self.prefill_chunk]
            logits = self._forward(chunk, start)
            self.cached += chunk
        budget = min(params.max_tokens or self.max_model_len, self.max_model_len - len(prompt_ids))
        for i in range(budget):
            if i < params.min_tokens and stops:
                logits[:, list(stops)] = float("-inf")
            token = int(sample(logits, [params], [generator])[0])
            if token in stops:
                return
            yield token
            if i + 1 == budget:
                return
            logits = self._forward([token], len(self.cached))
            self.cached.append(token)
