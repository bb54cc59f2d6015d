"""Turn a batch of next-token logits into chosen tokens, one SamplingParams per row."""
from __future__ import annotations

import torch

from runlm.engine.sampling_params import SamplingParams


def make_generator(seed: int | None) -> torch.Generator | None:
    """A per-request generator so a seeded request samples the same whatever runs beside it."""
    if seed is None:
        return None
    g = torch.Generator(device="cpu")
    g.manual_seed(seed % 2**64)
    return g


def _filter_row(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on one row of float32 logits -> probabilities."""
    row = row / p.temperature
    if p.top_k and p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(-1)
        drop = cumulative - sorted_probs > p.top_p  # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits: [B, V] (already penalised/masked). Returns [B] token ids (int64, CPU)."""
    logits = logits.float().cpu()
    out = torch.empty(logits.shape[0], dtype=torch.long)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        out[greedy] = logits[greedy].argmax(dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = _filter_row(logits[i], p)
        out[i] = torch.multinomial(probs, 1, generator=generators[i]).item()
    return out
