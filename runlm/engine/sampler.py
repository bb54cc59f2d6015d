"""From next-token logits to chosen tokens: per-request logits processing, sampling, logprobs.

Every row has its own SamplingParams and, when seeded, its own torch.Generator, so a
request samples the same tokens whatever else is in the batch.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from runlm.engine.outputs import Logprob
from runlm.engine.sampling_params import SamplingParams


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device="cpu")
    g.manual_seed(seed % 2**64)
    return g


def _changes_logits(p: SamplingParams, num_output: int, stops: frozenset[int] | set[int]) -> bool:
    return bool(p.logit_bias) or p.allowed_token_ids is not None or (num_output < p.min_tokens and bool(stops)) \
        or p.repetition_penalty != 1.0 or bool((p.presence_penalty or p.frequency_penalty) and num_output)


def process_logits(logits: torch.Tensor, params: Seq[SamplingParams], prompt_ids: Seq[list[int]],
                   output_ids: Seq[list[int]], stop_ids: Seq[frozenset[int] | set[int]]) -> torch.Tensor:
    """Logit bias, allowed tokens, min_tokens and the three penalties, row by row (in place on a copy).
    Rows that need none of them (plain greedy, top-k/top-p sampling) cost no copy: ``logits`` itself
    comes back."""
    if not any(_changes_logits(p, len(o), s) for p, o, s in zip(params, output_ids, stop_ids)):
        return logits
    logits = logits.float().clone()
    vocab = logits.shape[-1]
    for i, p in enumerate(params):
        row = logits[i]
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=row.dtype))
        if p.allowed_token_ids is not None:
            keep = torch.full((vocab,), float("-inf"))
            keep[torch.tensor(p.allowed_token_ids, dtype=torch.long)] = 0.0
            row += keep
        if len(output_ids[i]) < p.min_tokens and stop_ids[i]:
            row[torch.tensor(sorted(stop_ids[i]), dtype=torch.long)] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompt_ids[i]) | set(output_ids[i])), dtype=torch.long)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and output_ids[i]:
            counts = torch.bincount(torch.tensor(output_ids[i], dtype=torch.long), minlength=vocab)[:vocab].float()
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return logits


def probabilities(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, min-p and top-p on one row -> a probability vector."""
    row = row / p.temperature
    if p.top_k and p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs > p.top_p  # smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


def sample(logits: torch.Tensor, params: Seq[SamplingParams],
           generators: Seq[torch.Generator | None]) -> torch.Tensor:
    """logits: [B, V], already processed. Returns [B] token ids."""
    logits = logits.float()
    out = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = torch.multinomial(probabilities(logits[i], p), 1, generator=generators[i])[0]
    return out


def token_logprobs(logprobs: torch.Tensor, chosen: int, k: int) -> dict[int, Logprob]:
    """The chosen token's logprob and rank, plus the top k (vLLM's per-position dict)."""
    chosen_lp = float(logprobs[chosen])
    entry = {chosen: Logprob(chosen_lp, int((logprobs > chosen_lp).sum()) + 1)}
    if k:
        values, ids = torch.topk(logprobs, k)
        for rank, (tid, lp) in enumerate(zip(ids.tolist(), values.tolist()), start=1):
            entry.setdefault(tid, Logprob(lp, rank))
    return entry
